"""Pipeline accounting (accounting/pipeline.py) against schedules played out step by step and
against stages cut from a real model: the bubble, micro-batches in flight, the balanced split,
each stage's parameter, gradient, optimizer and saved-activation bytes, the plan's pipeline
section, `lmforge plan`'s stage table and the per-stage predicted-vs-measured rows."""

import copy
import io
import itertools
import json

import pytest
import torch
from rich.console import Console

from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.accounting.activations import activation_breakdown
from lmforge.accounting.pipeline import (balanced_split, bubble_fraction, micro_batches_in_flight, stage_costs,
                                         stage_layers)
from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.common.errors import LmforgeError
from tests.plan_configs import config_of
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.accounting.plan.tables import print_comparison
from lmforge.modes import get_policy
from lmforge.precision.policy import autocast, prepare_model
from lmforge.wrap import apply_recompute
from lmforge.runs.state import RunState
from lmforge.train.measurements import RunMeasurements
from lmforge.train.summary import predicted_vs_measured


# -- the schedules, played out -------------------------------------------------------------------

def actions(schedule: str, p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """What stage `stage` runs, in order: GPipe every forward then every backward; 1F1B p - s - 1
    warm-up forwards, then one forward one backward, then the remaining backwards."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - stage - 1, m)
    steady = [a for i in range(m - warmup) for a in (("F", warmup + i), ("B", i))]
    return [("F", i) for i in range(warmup)] + steady + [("B", i) for i in range(m - warmup, m)]


def play(schedule: str, times: list[tuple[float, float]], m: int) -> tuple[float, list[int]]:
    """(the step's length, the most micro-batches alive on each stage) when stage s takes
    times[s] = (forward, backward) per micro-batch: a forward waits for the previous stage's, a
    backward for the next stage's, each stage runs its actions in order."""
    p = len(times)
    queues = [actions(schedule, p, m, s) for s in range(p)]
    done: dict = {}
    free = [0.0] * p
    alive, most = [0] * p, [0] * p
    while any(queues):
        for s in range(p):
            if not queues[s]:
                continue
            kind, i = queues[s][0]
            needs = (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" and s < p - 1 else None
            if needs is not None and needs not in done:
                continue
            start = max(free[s], done[needs] if needs else 0.0)
            free[s] = done[s, kind, i] = start + times[s][0 if kind == "F" else 1]
            alive[s] += 1 if kind == "F" else -1
            most[s] = max(most[s], alive[s])
            queues[s].pop(0)
    return max(free), most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_and_micro_batches_in_flight_are_what_the_schedules_do(schedule):
    for p, m in itertools.product(range(1, 6), range(1, 10)):
        length, most = play(schedule, [(1.0, 2.0)] * p, m)
        # equal stages: (m + p - 1)(t_f + t_b), of which each computes m(t_f + t_b)
        assert length == (m + p - 1) * 3.0
        assert 1 - m * 3.0 / length == pytest.approx(bubble_fraction(p, m), abs=1e-12)
        assert most == [micro_batches_in_flight(schedule, p, m, s) for s in range(p)]
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(1, 5) == 0
    assert [micro_batches_in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_unequal_stages_run_at_the_slowest_ones_pace(schedule):
    """The plan's step, (m + p - 1) x the slowest stage, bounds the played one from above (a step
    only grows when a stage slows down to the slowest one's pace, where the bound is exact), and
    the slowest stage's own m micro-batches bound it from below."""
    for seconds in ([1, 3, 1, 1], [2, 1, 1, 1], [1, 1, 1, 4], [3, 1, 2], [1, 2]):
        p, m = len(seconds), 8
        length, _ = play(schedule, [(t, 2 * t) for t in seconds], m)
        slowest = 3 * max(seconds)
        assert m * slowest < length < (m + p - 1) * slowest


# -- the split -------------------------------------------------------------------------------------

SHAPES = {
    "small": ("small", []),
    "seven-layers": ("tiny", ["model.n_layers=7"]),
    "costly-head": ("tiny", ["model.n_layers=8", "model.vocab_size=32000"]),
    "gpt": ("tiny", ["model.n_layers=5", "model.family=gpt", "model.n_kv_heads=null"]),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_balanced_split_is_the_cheapest_of_every_contiguous_split(shape):
    preset, overrides = SHAPES[shape]
    cfg = make_config(preset, overrides=overrides).model
    n, seq = cfg.n_layers, 64
    for p in range(1, n + 1):
        split = balanced_split(cfg, p, seq)
        assert len(split) == p and sum(split) == n and min(split) >= 1
        best = min(max(stage_costs(cfg, seq, [b - a for a, b in zip((0, *cuts), (*cuts, n))]))
                   for cuts in itertools.combinations(range(1, n), p - 1))
        assert max(stage_costs(cfg, seq, split)) == best
        even = [n // p + (1 if i < n % p else 0) for i in range(p)]
        assert max(stage_costs(cfg, seq, split)) <= max(stage_costs(cfg, seq, even))


def test_stages_activations_add_up_to_the_whole_models():
    """Cut anywhere, the layers, the embedding's and head's terms and the weight casts add up to
    the whole model's; only the rotary tables are kept by every stage."""
    cfg = make_config("tiny", overrides=["model.n_layers=5"]).model
    for split in ([1, 4], [2, 2, 1], [1, 1, 1, 1, 1]):
        stages = [activation_breakdown(cfg, 2, 32, get_policy("bf16-mixed"), layers=len(layers), first=s == 0,
                                       last=s == len(split) - 1) for s, layers in enumerate(stage_layers(split))]
        whole = activation_breakdown(cfg, 2, 32, get_policy("bf16-mixed"))
        for key in whole:
            copies = len(split) if key == "rope_tables" else 1
            assert sum(stage[key] for stage in stages) == copies * whole[key], key


# -- each stage against a stage cut from a real model ---------------------------------------------

def cut(model: Transformer, split: list[int], stage: int) -> Transformer:
    """Stage `stage` as the pipeline engine cuts it: its blocks (named as in the whole model), the
    embeddings on the first, the final norm and head on the last (a tied head keeps the matrix)."""
    part = copy.deepcopy(model)
    for name in list(part.blocks):
        if int(name) not in stage_layers(split)[stage]:
            del part.blocks[name]
    if stage > 0:
        part.tok_embeddings = part.pos_embeddings = None
    if stage < len(split) - 1:
        part.norm = part.lm_head = None
    return part


def stage_inputs(cfg, policy, stage: int, b: int, s: int):
    """Token ids for the first stage; for the others the hidden states a previous stage sends
    (b, s, d) in the residual stream's dtype, a leaf that takes a gradient."""
    if stage == 0:
        return torch.randint(0, cfg.vocab_size, (b, s))
    dtype = {4: torch.float32, 2: torch.bfloat16}[policy.bytes.residual]
    return torch.randn(b, s, cfg.d_model, dtype=dtype, requires_grad=True)


CONFIGS = {
    "tied": [],
    "untied": ["model.tie_embeddings=false"],
    "gpt": ["model.family=gpt", "model.n_kv_heads=null"],
}


def planned_stages(cfg, split, precision, recompute="none", b=3, s=48, m=4, schedule="1f1b"):
    run = config_of(cfg, f"train.batch_size={b}", f"train.seq_len={s}", f"train.precision={precision}",
                    f"train.recompute={recompute}", f"parallel.pp={len(split)}", f"train.micro_batches={m}",
                    f"train.schedule={schedule}", f"train.pipeline_split={','.join(map(str, split))}")
    return make_plan(run, Costing(hardware="h100-sxm"))["pipeline"]["stages_detail"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("split", [[1, 3], [2, 1, 1]])
@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_each_stage_holds_the_parameters_gradients_and_adamw_states_planned(name, split, precision):
    cfg = make_config("tiny", overrides=["model.n_layers=4", *CONFIGS[name]]).model
    policy = get_policy(precision)
    torch.manual_seed(0)
    model = Transformer(cfg)
    prepare_model(model, policy)
    for stage, planned in enumerate(planned_stages(cfg, split, precision)):
        part = cut(model, split, stage)
        optimizer = AdamW(part.parameters(), lr=1e-3)
        x = stage_inputs(cfg, policy, stage, 2, 16)
        with autocast(policy, torch.device("cpu")):
            out = part(x, torch.randint(0, cfg.vocab_size, (2, 16))) if stage == len(split) - 1 else part(x)
        out.float().sum().backward()
        optimizer.step()
        measured = model_state_bytes_measured(part, optimizer)
        assert measured == {key: planned["breakdown_bytes"][key] for key in measured}, stage
        assert planned["parameter_count"] == sum(p.numel() for p in part.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_stage_saves_the_activations_planned(family, precision, recompute):
    overrides = ["model.n_layers=4"] + (["model.family=gpt", "model.n_kv_heads=null"] if family == "gpt" else [])
    cfg = make_config("tiny", overrides=overrides).model
    policy = get_policy(precision)
    split, b, s = [1, 2, 1], 3, 48
    model = Transformer(cfg)
    prepare_model(model, policy)
    apply_recompute(model, recompute)
    for stage, planned in enumerate(planned_stages(cfg, split, precision, recompute, b, s)):
        part = cut(model, split, stage)
        x = stage_inputs(cfg, policy, stage, b, s)
        with autocast(policy, torch.device("cpu")), measure_saved_bytes(part.parameters()) as saved:
            out = part(x, torch.randint(0, cfg.vocab_size, (b, s))) if stage == len(split) - 1 else part(x)
        out.float().sum().backward()  # the graph is really usable
        # counted tensor by tensor: exact, but for the loss's scalar on the last stage
        assert abs(planned["activations_per_micro_batch_bytes"] - saved.activations) <= 8, stage
        assert planned["activations_in_flight_bytes"] == (planned["activations_per_micro_batch_bytes"]
                                                          * planned["micro_batches_in_flight"])


# -- the plan --------------------------------------------------------------------------------------

def test_plan_takes_the_largest_stage_and_the_slowest_stages_pace():
    cfg = make_config("small").model
    b, s = 8, 256
    setup = (f"train.batch_size={b}", f"train.seq_len={s}", "train.micro_batches=8")
    plan = make_plan(config_of(cfg, *setup, "parallel.pp=4"), Costing(hardware="h100-sxm", mfu=0.5))
    piped, stages = plan["pipeline"], plan["pipeline"]["stages_detail"]
    assert plan["setup"]["tokens_per_step"] == b * s * 8
    assert piped["split"] == [2, 2, 1, 1] and piped["bubble_fraction"] == 3 / 11
    assert [d["micro_batches_in_flight"] for d in stages] == [4, 3, 2, 1]
    assert [d["layers"] for d in stages] == [[0, 1], [2, 3], [4, 4], [5, 5]]
    for d in stages:  # a device holds the activations of every micro-batch in flight, and one set of logits
        parts = d["breakdown_bytes"]
        assert parts["activations"] + parts["weight_copies"] == d["activations_in_flight_bytes"]
        assert d["total_bytes"] == sum(parts.values()) and (parts["logits"] > 0) == (d["stage"] == 3)
    assert plan["memory"]["per_device_bytes"] == max(d["total_bytes"] for d in stages) == stages[0]["total_bytes"]
    assert plan["memory"]["breakdown_bytes"] == stages[0]["breakdown_bytes"]
    # the tied matrix is held twice: by the first stage and by the last
    assert sum(d["parameter_count"] for d in stages) == plan["model"]["parameters"] + cfg.vocab_size * cfg.d_model
    slowest = max(d["seconds_per_micro_batch"] for d in stages)
    assert plan["time"]["seconds_per_step"] == piped["seconds_per_step"] == 11 * slowest
    # without the bubble: the same FLOPs spread over the 4 devices, as a plan without a pipeline
    flat = make_plan(config_of(cfg, f"train.batch_size={b * 2}", f"train.seq_len={s}"),
                     Costing(hardware="h100-sxm", mfu=0.5, dp=4))
    assert flat["setup"]["tokens_per_step"] == plan["setup"]["tokens_per_step"]
    assert piped["ideal_seconds_per_step"] == pytest.approx(flat["time"]["seconds_per_step"], rel=1e-12)
    assert piped["best_mfu"] == pytest.approx(0.5 * piped["ideal_seconds_per_step"] / piped["seconds_per_step"])
    # an unbalanced split is slower, and its slow stage is the one named
    lopsided = make_plan(config_of(cfg, *setup, "parallel.pp=2", "train.pipeline_split=5,1"),
                         Costing(hardware="h100-sxm"))["pipeline"]
    balanced = make_plan(config_of(cfg, *setup, "parallel.pp=2"), Costing(hardware="h100-sxm"))["pipeline"]
    assert lopsided["slowest_stage"] == 0 and lopsided["seconds_per_step"] > balanced["seconds_per_step"]
    assert balanced["split_source"] == "balanced" and lopsided["split_source"] == "given"
    # GPipe keeps every micro-batch on every stage
    gpipe = make_plan(config_of(cfg, *setup, "parallel.pp=4", "train.schedule=gpipe"),
                      Costing(hardware="h100-sxm"))["pipeline"]["stages_detail"]
    assert [d["micro_batches_in_flight"] for d in gpipe] == [8] * 4


def test_what_each_stage_sends():
    cfg = make_config("small").model
    b, s, m, dp = 4, 128, 6, 2
    plan = make_plan(config_of(cfg, f"train.batch_size={b}", f"train.seq_len={s}", "parallel.pp=3",
                               f"train.micro_batches={m}", "train.parallel=ddp"), Costing(hardware="h100-sxm", dp=dp))
    stages = plan["pipeline"]["stages_detail"]
    hidden = m * b * s * cfg.d_model * 4  # fp32 hidden states, every micro-batch
    assert [d["sent_bytes_per_step"]["activations"] for d in stages] == [hidden, hidden, 0]
    assert [d["sent_bytes_per_step"]["activation_gradients"] for d in stages] == [0, hidden, hidden]
    tied = cfg.vocab_size * cfg.d_model * 4
    assert [d["sent_bytes_per_step"]["tied_embedding_gradient"] for d in stages] == [tied, 0, tied]
    # each stage's replicas all-reduce its gradients: a ring of 2 sends 2 (N-1)/N of them
    for d in stages:
        assert d["sent_bytes_per_step"]["data_parallel"] == 2 * (dp - 1) / dp * d["parameter_count"] * 4
    assert plan["communication"]["sent_bytes"] == stages[0]["sent_bytes_per_step"]["data_parallel"]


def test_pipelines_refuse_what_they_cannot_do():
    def plan(*overrides, dp=1):
        return make_plan(make_config("small", overrides=list(overrides)), Costing(hardware="h100-sxm", dp=dp))

    with pytest.raises(Exception, match="model has 6 layers"):
        plan("parallel.pp=7")
    with pytest.raises(LmforgeError, match=r"use train.parallel=zero1 \(shards each stage's optimizer states\) or ddp"):
        plan("parallel.pp=2", "train.parallel=zero2", dp=2)
    with pytest.raises(LmforgeError, match="set train.micro_batches instead"):
        plan("parallel.pp=2", "train.grad_accum=2")
    with pytest.raises(LmforgeError, match="train.schedule must be one of"):
        plan("parallel.pp=2", "train.schedule=zigzag")


def test_the_plan_reads_the_pipeline_from_the_config():
    cfg = make_config("small", overrides=["parallel.pp=3", "train.micro_batches=5", "train.schedule=gpipe",
                                          "train.pipeline_split=1,2,3"])
    piped = make_plan(cfg, Costing(hardware="h100-sxm"))["pipeline"]
    assert (piped["stages"], piped["micro_batches"], piped["schedule"], piped["split"]) == (3, 5, "gpipe", [1, 2, 3])


# -- lmforge plan ----------------------------------------------------------------------------------

def test_plan_command_prints_each_stage_and_the_bubble(capsys):
    args = ["plan", "--hardware", "h100-sxm", "train.micro_batches=8", "train.schedule=1f1b"]
    assert main([*args, "--pp", "4", "--json"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    assert main([*args, "parallel.pp=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_flag  # --pp is parallel.pp
    assert by_flag["pipeline"]["stages"] == 4 and by_flag["setup"]["devices"] == 4
    assert main([*args, "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline stages (1f1b, 8 micro-batches)" in out
    assert "(p - 1) / (m + p - 1) = 3/11 = 27.3%" in out and "MFU at best" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert [row[:2] for row in rows] == [["0", "0-1"], ["1", "2-3"], ["2", "4"], ["3", "5"]]
    assert [row[-5] for row in rows] == ["4", "3", "2", "1"]  # "80.23 MiB x 4": micro-batches in flight


@pytest.mark.parametrize("args, message", [
    (["--pp", "7"], "parallel.pp=7 but the model has 6 layers"),
    (["--pp", "2", "parallel.pp=2"], "--pp and parallel.pp say the same"),
    (["--pp", "2", "train.pipeline_stages=2"], "--pp and parallel.pp say the same"),  # its older name too
    (["--pp", "2", "--zero-stage", "2"], "train.parallel=zero2 does not combine with parallel.pp=2: ZeRO-2"),
])
def test_plan_command_refuses_pipelines_in_one_line(args, message, capsys):
    assert main(["plan", "--hardware", "h100-sxm", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmforge: error: {message}") and err.count("\n") == 1


# -- predicted vs measured -------------------------------------------------------------------------

def fake_measurements(plan: dict, measured_by_stage=None) -> RunMeasurements:
    """A run's measurements as predicted_vs_measured reads them: no memory measured yet, a
    pipeline's per stage."""
    return RunMeasurements(state=RunState(), device=torch.device("cpu"), precision="fp32", parameters=0,
                           tokens_per_step=0, flops_per_token=plan["flops"]["training_per_token"],
                           hardware_flops_per_token=None, peak_dtype="float32", peak_flops=4e12,
                           world_peak_flops=4e12, start_step=0,
                           pipeline=None if measured_by_stage is None else {"measured_by_stage": measured_by_stage})


def test_the_mfu_row_predicts_the_utilisation_at_the_rooflines_step_time():
    """With a roofline the MFU row's prediction is the MFU at the predicted step time (not the 100%
    bound), so its measured / predicted is the predicted / measured step time."""
    plan = make_plan(make_config("tiny"), Costing(hardware="h100-sxm", mfu=1.0))
    plan["roofline"] = {"seconds_per_step": 0.02}
    run = fake_measurements(plan)
    run.tokens_per_step = 1000
    rows = predicted_vs_measured(plan, run, tokens_per_s=25_000.0)  # measured: 0.04 s a step
    assert rows["step_seconds"] == {"predicted": 0.02, "measured": pytest.approx(0.04)}
    assert rows["mfu"]["predicted"] == pytest.approx(run.mfu(1000 / 0.02))
    assert rows["mfu"]["measured"] / rows["mfu"]["predicted"] == pytest.approx(0.5)
    del plan["roofline"]
    assert predicted_vs_measured(plan, run, tokens_per_s=25_000.0)["mfu"]["predicted"] == 1.0  # the bound


def test_predicted_vs_measured_has_a_row_per_stage():
    plan = make_plan(make_config("small", overrides=["parallel.pp=2", "train.micro_batches=4"]),
                     Costing(hardware="h100-sxm", mfu=1.0))
    stages = plan["pipeline"]["stages_detail"]
    measured = [{"parameters": 11, "gradients": 12, "optimizer_states": 13, "activations": 14,
                 "activations_in_flight": 15 + stage} for stage in range(2)]
    rows = predicted_vs_measured(plan, fake_measurements(plan, measured), tokens_per_s=1000.0)
    for stage in range(2):
        assert rows[f"stage {stage} parameters_bytes"] == {"predicted": stages[stage]["breakdown_bytes"]["parameters"],
                                                          "measured": 11}
        assert rows[f"stage {stage} activations_bytes"] == {
            "predicted": stages[stage]["activations_per_micro_batch_bytes"], "measured": 14}
        assert rows[f"stage {stage} activations_in_flight_bytes"] == {
            "predicted": stages[stage]["activations_in_flight_bytes"], "measured": 15 + stage}
    assert "parameters_bytes" not in rows  # one device's rows would mix stages
    assert rows["mfu"]["predicted"] == plan["pipeline"]["best_mfu"] < 1
    console = Console(file=io.StringIO(), width=150)
    print_comparison(console, rows)
    text = console.file.getvalue()
    assert "stage 1: saved for backward, peak alive at once" in text and "stage 0: optimizer states" in text
    # before the trainer measures stages, the predictions stand alone
    rows = predicted_vs_measured(plan, fake_measurements(plan), tokens_per_s=1000.0)
    assert rows["stage 1 gradients_bytes"]["measured"] is None
    # a run without a pipeline keeps its one-device rows
    flat = make_plan(make_config("small"), Costing(hardware="h100-sxm"))
    rows = predicted_vs_measured(flat, fake_measurements(flat), tokens_per_s=1000.0)
    assert "parameters_bytes" in rows and not any(key.startswith("stage ") for key in rows)
