"""Sequence parallelism inside context parallelism, and replicated KV heads under cp and FSDP2: 4 ranks,
one launch (tests/sp_cp_worker.py), real gloo process groups, the `tiny` model, fp32 (one cell bf16-mixed).

    tp 2 x cp 2, parallel.sequence_parallel=true   each cp rank's zig-zag shard of n tokens is cut
                                                   again over its tp pair (n / 2 each); 32 tokens (a
                                                   multiple of 2 cp tp = 8), 28 (not: n = 14, 7 per
                                                   tp rank), 29 with prompts (padded to 32)
                                                   (also bf16-mixed, and LoRA with full recomputation)
    tp 2 over one KV head x cp 2                   each tp rank's ring carries its copy of the head
    the same with sequence parallelism
    tp 2 over one KV head x fsdp dp 2              FSDP2's new parameters: tp_engine.py sums the copies

against one process on the same global batch: 3 steps of 2 accumulated micro-batches (losses,
gradient norms, final weights, the ring's bytes and the model states as planned: tests/
test_cp_compose_dist.py's assert_cell; also in bf16-mixed, to its 16-bit bounds) and the first
step's gradients gathered to full tensors by name. And
the plan (`lmforge plan`'s make_plan) of the tp 2 x cp 2 sequence-parallel layout against what each
rank saves for backward, holds and sends (the ring, the tp group, the gradient all-reduce), and
FSDP2's held bytes against model_state_bytes: all exact (==: the same tensors counted).

Tolerances (fp32). Losses 1e-6 and norms 2e-6 relative, weights as tests/test_cp_train_dist.py
(the ring, the tp reductions and the dp x cp all-reduce sum in another order than one process;
measured here: losses within 1.4e-7, norms 3.4e-7). Gradients: tests/test_tp_dist.py's 2e-6 absolute
+ 1e-4 relative (the same rounding of the summation order; measured 1.9e-7 at most, the largest
gradient 0.17). What they catch, broken by hand once each: the rotary tables at rows 0..n-1 of each
cp shard instead of its zig-zag positions under sequence parallelism (losses off by 7.3e-3, norms
1.7e-2, gradients 0.11); FSDP2 without the copies' sum (losses 3.9e-4, norms 2.9e-2). FSDP2 against
one process: test_tp_dist.py's 1e-5 (measured: losses equal, norms 2.3e-7), and against the same
mesh under ddp tests/test_tp_zero_dist.py's 1e-6 (measured: weights within 2.3e-7).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cp_accounting_worker import cp_config  # noqa: E402
from test_cp_compose_dist import LORA, assert_cell  # noqa: E402
from test_cp_train_dist import settings  # noqa: E402,F401 (settings: a fixture)
from test_pipeline import run_worker  # noqa: E402
from test_tp_dist import one_process  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.accounting.memory import model_state_bytes  # noqa: E402
from lmforge.accounting.plan.make import Costing, make_plan  # noqa: E402
from lmforge.modes import get_policy, get_strategy

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "sp_cp_worker.py"
TP, SP, MQA = "parallel.tp=2", "parallel.sequence_parallel=true", "model.n_kv_heads=1"
TRAIN = {"train:sp": [TP, SP], "train:sp28": [TP, SP, "seq=28"], "train:sp sft29": [TP, SP, "+sft", "seq=29"],
         "train:mqa": [TP, MQA], "train:mqa sp": [TP, MQA, SP],
         "train:sp bf16-mixed": [TP, SP, "train.precision=bf16-mixed"],
         "train:sp LoRA recompute=full": [TP, SP, *LORA, "train.recompute=full"]}
GRADS = {"grads:sp": [TP, SP], "grads:sp28": [TP, SP, "seq=28"], "grads:mqa": [TP, MQA]}
PLAN = {"plan:sp": ["parallel.cp=2", TP, SP], "plan:sp29": ["parallel.cp=2", TP, SP, "train.seq_len=29"],
        "plan:mqa sp": ["parallel.cp=2", TP, SP, MQA]}
FSDP = {"fsdp:fsdp mqa": [MQA], "fsdp:ddp mqa": [MQA]}
MACHINE = ("test", 1e12, 2**40)  # a made-up device: bytes do not depend on it


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("sp-cp"), 4, {**TRAIN, **GRADS, **PLAN, **FSDP}, WORKER)


@pytest.mark.parametrize("name", list(TRAIN))
def test_tp2_times_cp2_trains_as_one_process(four_ranks, name):
    for rank, case in enumerate(four_ranks[name]):
        assert (case["replicas"], case["cp_rank"]) == (1, rank // 2)  # rank = cp_index * tp + tp_index
        # one process's numbers (16-bit bounds in bf16-mixed), the ring's bytes and the model states as planned
        assert_cell(name, TRAIN[name], case)


@pytest.mark.parametrize("name", list(GRADS))
def test_first_gradients_are_one_process_gradients(four_ranks, name):
    for case in four_ranks[name]:
        assert case["grads"].keys() == case["ref"].keys()
        for key, grad in case["ref"].items():
            torch.testing.assert_close(case["grads"][key], grad, atol=2e-6, rtol=1e-4, msg=(name, key))


def planned(overrides: list[str]) -> dict:
    """What make_plan says one of the 4 ranks saves, holds and sends (tests/test_cp_accounting_dist.py's terms)."""
    cfg = cp_config(overrides)
    plan = make_plan(cfg, Costing(dp=1), MACHINE)
    memory, sent = plan["memory"], plan["communication"]
    saved = sum(memory["activation_breakdown_bytes"].values()) + memory["breakdown_bytes"]["weight_copies"]
    states = ("parameters", "gradients", "optimizer_states")
    return dict(saved=saved, state={k: memory["breakdown_bytes"][k] for k in states},
                sent={"model": sent["sent_bytes"], "ring": sent["context_parallel"]["sent_bytes"],
                      "tp": sent["tensor_parallel"]["sent_bytes"]})


@pytest.mark.parametrize("name", list(PLAN))
def test_plan_equals_measured_per_rank(four_ranks, name):
    plan = planned(PLAN[name])
    for rank, measured in enumerate(four_ranks[name]):
        assert measured == plan, (name, rank)


def test_sequence_parallelism_saves_what_the_plan_says_it_saves(four_ranks):
    """What sequence parallelism buys inside cp: the norms and the residual stream on n / tp tokens,
    measured against the same layout without it (planned == measured above, for both)."""
    without = planned(["parallel.cp=2", TP])
    with_sp = four_ranks["plan:sp"][0]
    assert with_sp["saved"] < without["saved"]
    assert with_sp["state"] == without["state"]  # the same weights: the split is of activations only
    assert with_sp["sent"]["ring"] == without["sent"]["ring"]  # the ring carries the whole cp shard either way


def test_fsdp2_over_a_replicated_kv_head_trains_as_one_process_and_holds_the_plan(four_ranks):
    reference, mesh = one_process(replicas=2, extra=[MQA]), four_ranks["fsdp:ddp mqa"][0]
    plan = model_state_bytes(tp_config(2, 4, [MQA]).model, get_policy("fp32"), "adamw", get_strategy("fsdp").zero_stage,
                             dp=2, tp=2, fully_shard=True)
    for rank, result in enumerate(four_ranks["fsdp:fsdp mqa"]):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), rank
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5), rank
        assert result["losses"] == pytest.approx(mesh["losses"], rel=1e-6), rank
        assert result["norms"] == pytest.approx(mesh["norms"], rel=1e-6), rank
        assert result["model"].keys() == mesh["model"].keys()
        for key, tensor in mesh["model"].items():  # full tensors by name: each KV head once
            torch.testing.assert_close(result["model"][key], tensor, rtol=0, atol=1e-6, msg=(rank, key))
        k_proj = "blocks.0.attn.k_proj.weight"  # the one KV head, once
        assert result["model"][k_proj].shape == reference["model"][k_proj].shape
        assert result["held"] == {k: plan[k] for k in result["held"]}, rank


@pytest.mark.slow
def test_lmforge_train_tp2_times_cp2_with_sequence_parallelism_trains_as_one_process(tmp_path, settings):
    """`lmforge train` on 4 ranks, tp=2 x cp=2, sequence parallel (evaluation, checkpoints): the same
    train and validation losses as one process within 1e-5 and the same weights (test_tp_train_dist.py's
    bounds), and the end-of-run table's bytes predicted == measured."""
    import json

    from tests.test_distributed_train import torchrun
    from tests.test_tp_train_dist import assert_close_runs, run
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(4), "--out", "one"],
        tmp_path)
    run(torchrun(4, "--model", "tiny", *settings(4), TP, "parallel.cp=2", SP, "train.parallel=ddp", "--out", "spcp"),
        tmp_path)
    assert_close_runs(tmp_path / "spcp", tmp_path / "one")
    table = json.loads((tmp_path / "spcp" / "summary.json").read_text())["predicted_vs_measured"]
    for row in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes", "activations_bytes",
                "cp_sent_bytes_per_step"):
        print(row, table[row])  # for docs/context-parallel.md
        assert table[row]["measured"] == table[row]["predicted"], (row, table[row])
