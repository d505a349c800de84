"""Tensor parallelism in fp16-mixed and fp8 (issue 23 part 5): parallel.tp=2 (2 ranks; also with
LoRA), and on 4 ranks tp=2 x 2 replicas under ddp, zero1, zero2, zero3 and fsdp, and tp=2 x cp=2,
trained 3 steps against one process in the same policy on the same global batches
(tests/tp_precision_worker.py, one torchrun launch per world size; a third, slow, trains pipelines
of tp stages with tests/pipeline_compose_worker.py). In every cell each rank holds the bytes the plan says
(accounting/memory.py's model_state_bytes with tp), and, but under cp and LoRA (whose traffic the
plan does not model), the tp group sends the bytes the plan says (accounting/comm.py's
tensor_parallel_communication, fp8's amax all-reduces included).

fp16-mixed: the loss scaler's found-inf is agreed over the tp group and the dp group
(parallel/tp_engine.py's found_inf_anywhere). The "+inf" cells put an inf into one gradient element
on global rank 0 only, at step INF_STEP: every rank must skip that step, as one process with the
same inf does, and end with the same scaler and the same copy of every whole parameter. Broken on
purpose once (the tp all-reduce removed): rank 0 skipped while rank 1 went on to the gradient
norm's all-reduce, rank 0 to the next step's embedding all-reduce; gloo failed on the mismatched
collectives and the launch, so the test, failed. (Had the collectives lined up, rank 1 would have
stepped alone: its norm gains and loss scale would have parted from rank 0's, which "agree" checks.)

fp8: each split linear takes its scales from the whole tensor's amax, all-reduced (max) over tp
(parallel/tp_fp8.py). So at step 0, at identical weights, every layer's weight amax equals one
process's exactly (the "fp8 delayed" cell records them). Broken on purpose once (each slice's own
amax): 8 of the 14 layers' first weight amax missed one process's, the two ranks' histories
differed ("agree"), and the tp traffic was 448 bytes under the plan; the losses under current
scaling were bit for bit the same (power-of-two scales: only subnormal values could round
differently, parallel/tp_fp8.py), so the scales are checked directly, not through the losses.

Tolerances: tests/test_composition_dist.py's, 16-bit (SIXTEEN_BIT) for fp16-mixed, fp8's for
fp8, each several times below what training on other rows gives (its docstring). Below fp32 the
ranks round each row-parallel partial product to 16 bits before g sums them, where one process
rounds the whole sum once (tests/test_tp_compose_dist.py measured that for bf16: losses 7e-4).
The amax histories: the first step's weights exactly; the first step's inputs to 2e-2 relative
(measured 7.3e-3, the first micro-batch's activations carrying tp's roundings; one process on
other rows: 0.14). Later entries and the gradients' follow those roundings through E5M2's 2
mantissa bits (measured up to 10% for inputs and 17.5% for gradients, other rows 66% and 59%): not
bounded one by one; every rank holding the same histories is ("agree").
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import ROWS, SEQ, make_engine  # noqa: E402
from pipeline_worker import config as pipeline_config  # noqa: E402
from test_composition_dist import SIXTEEN_BIT, TOLERANCES, update_error  # noqa: E402
from test_distributed_train import env, free_port  # noqa: E402
from test_pipeline import pipeline, run_worker, single_process  # noqa: E402
from tp_precision_worker import INF_STEP, STEPS, run  # noqa: E402
from tp_worker import ACCUM  # noqa: E402

from lmforge.accounting.comm import tensor_parallel_communication  # noqa: E402
from lmforge.accounting.lora import lora_parameters  # noqa: E402
from lmforge.accounting.memory import model_state_bytes, sharded_layout  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy, get_strategy
from lmforge.train.setup import build_engine  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "tp_precision_worker.py"
PIPELINE_WORKER = Path(__file__).parent / "pipeline_compose_worker.py"
M = 2  # micro-batches per pipeline step (tests/test_tp_pipeline_dist.py's)
TIMEOUT = 600  # a dead rank ends the launch sooner: the collectives time out after 60 s
FP16, FP8 = ["train.precision=fp16-mixed"], ["train.precision=fp8"]
POLICIES = {"fp16": FP16, "fp8": FP8}
LORA = ["finetune.lora_rank=4"]  # adapters on the model's own initialisation (as tests/test_tp_compose_dist.py)
CELLS_2 = {"fp16": FP16, "fp16+inf": FP16, "fp8": FP8, "fp8 delayed": [*FP8, "train.fp8_scaling=delayed"],
           "fp16 LoRA": [*FP16, *LORA], "fp8 LoRA": [*FP8, *LORA]}
SHARDED = ("ddp", "zero1", "zero2", "zero3", "fsdp")
CELLS_4 = {**{f"{s} {p}": [*POLICIES[p], f"train.parallel={s}"] for s in SHARDED for p in POLICIES},
           **{f"cp {p}": [*POLICIES[p], "parallel.cp=2"] for p in POLICIES},
           **{f"{s} fp16+inf": [*FP16, f"train.parallel={s}"] for s in ("ddp", "zero1", "fsdp")}}


def launch(tmp_path, ranks: int, cells: dict) -> dict:
    out = tmp_path / f"{ranks}.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                           f"--master_port={free_port()}", str(WORKER), str(out), json.dumps(cells)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def one_process(replicas: int, overrides: list[str], inject: bool) -> dict:
    """The same steps in one process on the global batch of replicas * ROWS rows (the same inf
    injected where `inject`), and its initial weights."""
    cfg = make_config("tiny", overrides=[f"train.grad_accum={ACCUM}", "train.sample_tokens=0",
                                         *[o for o in overrides if not o.startswith(("parallel.", "train.parallel"))]])
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    initial = {k: v.float().clone() for k, v in engine.model_state_dict().items()}
    return dict(run(engine, cfg, 0, 1, rows=replicas * ROWS, inject=inject), initial=initial)


def assert_trains_as_one_process(name: str, result: dict, reference: dict, precision: str) -> None:
    losses, first_norm, norms, update = SIXTEEN_BIT if precision == "fp16-mixed" else TOLERANCES["fp8"]
    if name.endswith("+inf"):  # the step with the inf skipped everywhere, its norm inf as one process's
        assert result["norms"][INF_STEP] == reference["norms"][INF_STEP] == float("inf"), name
        assert result["scaler"] == reference["scaler"] and result["scaler"][1] == 1, name
        kept = [i for i in range(STEPS) if i != INF_STEP]
        result = {**result, "norms": [result["norms"][i] for i in kept]}
        reference = {**reference, "norms": [reference["norms"][i] for i in kept]}
    assert result["agree"], name  # every rank: the same scaler, whole parameters and amax histories
    assert result["losses"] == pytest.approx(reference["losses"], rel=losses), name
    assert result["norms"][0] == pytest.approx(reference["norms"][0], rel=first_norm), name
    assert result["norms"] == pytest.approx(reference["norms"], rel=norms), name
    assert update_error(result["model"], reference["model"], reference["initial"]) <= update, name
    if "LoRA" in name:  # the base as it was: only the adapters moved
        assert all(torch.equal(t, reference["initial"][k]) for k, t in result["model"].items() if ".lora_" not in k)


def assert_bytes_equal_the_plan(name: str, result: dict, overrides: list[str], world: int) -> None:
    cfg = make_config("tiny", overrides=["parallel.tp=2", f"train.grad_accum={ACCUM}", "train.sample_tokens=0",
                                         f"train.parallel={'ddp' if world > 2 else 'none'}", *overrides])
    policy, strategy = get_policy(cfg.train.precision), get_strategy(cfg.train.parallel)
    dp = world // (2 * cfg.parallel.cp)
    f = cfg.finetune
    lora = lora_parameters(cfg.model, f.lora_rank, f.lora_targets, tp=2) if f.lora_rank is not None else None
    plan = model_state_bytes(cfg.model, policy, cfg.optim.name, zero_stage=strategy.zero_stage, dp=dp, tp=2,
                             lora_trainable=lora, fully_shard=strategy.name == "fsdp")
    assert {k: result["held"][k] for k in plan} == plan, name
    # the tp group's traffic of one step; not counted by the plan: cp's shards (tests/test_cp_compose_dist.py)
    # and LoRA's (A x leaves row-parallel layers through g; a frozen embedding skips the first f's backward)
    if cfg.parallel.cp == 1 and f.lora_rank is None:
        planned = tensor_parallel_communication(cfg.model, ROWS, SEQ, 2, False,
                                                sharded_layout(policy, strategy.zero_stage), ACCUM)
        assert result["tp_ring_bytes"] == sum(planned["ring_bytes"].values()), name


def check(results: dict, cells: dict, replicas_of, world: int) -> None:
    for name, overrides in cells.items():
        precision = "fp8" if FP8[0] in overrides else "fp16-mixed"
        reference = one_process(replicas_of(overrides), overrides, inject=name.endswith("+inf"))
        assert_trains_as_one_process(name, results[name], reference, precision)
        assert_bytes_equal_the_plan(name, results[name], overrides, world)


def test_tp2_trains_in_fp16_mixed_and_fp8_as_one_process(tmp_path):
    results = launch(tmp_path, 2, CELLS_2)
    check(results, CELLS_2, lambda overrides: 1, 2)
    # fp8's scales are the whole tensors': at step 0 (identical weights) every weight amax is one process's
    delayed, reference = results["fp8 delayed"], one_process(1, CELLS_2["fp8 delayed"], False)
    assert set(delayed["fp8_scales"]) == set(reference["fp8_scales"]) and delayed["fp8_scales"]
    for layer, history in delayed["fp8_scales"].items():
        ours = reference["fp8_scales"][layer]
        assert history["w"][0] == ours["w"][0], layer  # exact: a slice's own amax misses the max on one rank
        assert history["x"][0] == pytest.approx(ours["x"][0], rel=2e-2), layer
        assert [len(h) for h in history.values()] == [len(h) for h in ours.values()] == [STEPS * ACCUM] * 3, layer


@pytest.mark.slow  # 4 processes, 15 cells, on 2 shared cores
def test_tp2_times_every_data_parallel_strategy_and_cp_trains_in_fp16_mixed_and_fp8_as_one_process(tmp_path):
    results = launch(tmp_path, 4, CELLS_4)
    check(results, CELLS_4, lambda overrides: 1 if "parallel.cp=2" in overrides else 2, 4)


@pytest.mark.slow  # 4 processes on 2 shared cores
def test_pipelines_of_tp_stages_train_in_fp16_mixed_and_fp8_as_one_process(tmp_path):
    """2 stages x tp 2 (tests/test_tp_pipeline_dist.py's layout and worker): the pipeline engine
    agrees on found-inf over the whole world, and its stages hold the split fp8 linears; the same
    bounds as above, every rank's gathered tensors the same, the state loads back and steps on
    exactly. (Bytes: that file's test, the plan's stage figures are 0.2% under for pp x tp.)"""
    runs = {p: pipeline(2, "1f1b", M, "parallel.tp=2", *POLICIES[p]) for p in POLICIES}
    results = run_worker(tmp_path, 4, worker=PIPELINE_WORKER, runs=runs)
    for p in POLICIES:
        result, reference = results[p], single_process(M, 1, *POLICIES[p])
        losses, first_norm, norms, update = SIXTEEN_BIT if p == "fp16" else TOLERANCES["fp8"]
        assert result["losses"] == pytest.approx(reference["losses"], rel=losses), p
        assert result["norms"][0] == pytest.approx(reference["norms"][0], rel=first_norm), p
        assert result["norms"] == pytest.approx(reference["norms"], rel=norms), p
        cfg = pipeline_config(POLICIES[p])
        torch.manual_seed(cfg.train.seed)
        initial = make_engine(cfg, []).model_state_dict()
        assert update_error(result["model"], {k: reference["model"][k] for k in result["model"]}, initial) <= update, p
        assert result["replicas_equal"] and result["resumes_exactly"], p
