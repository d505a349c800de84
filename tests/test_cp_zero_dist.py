"""Context parallelism with every sharding strategy: parallel.cp=2 with train.parallel=zero1, zero2,
zero3 and fsdp over the dp x cp ranks (parallel/engine.py), on 2 ranks (cp 2) and 4 ranks
(dp 2 x cp 2, and tp 2 x cp 2 with dp 1). Real processes under torchrun, gloo, the `tiny` model;
tests/cp_zero_worker.py trains every run of a world size in one launch, 3 steps of 2 micro-batches
on parallel_worker's global batches, and one process on the whole global batch beside them.

Tolerances, fp32, each measured here and asserted with the margin said:
  - against cp x ddp on the same mesh (the same arithmetic but for the reduction's grouping): on 2
    ranks each gradient element is a + b either way, on 4 the reduce-scatter sums the 4 values in
    another order than the all-reduce, and the global norm sums its squares by pieces, not
    tensors. Measured: losses identical (0.0); norms within 1.7e-7 relative (asserted 1e-6);
    optimizer moments within 6.4e-9 (asserted 1e-6); weights within 9.2e-7 but for one of
    164,160 elements at 4.7e-6 (zero1-3 on 4 ranks: a gradient summed to near zero in another
    order, which AdamW, blind to scale, turns into a different ~lr step); asserted: at most
    0.01% of the elements beyond 1e-6, none beyond 2 x steps x lr. Not bit-identical, then:
    within fp32 summation-order rounding.
  - against one process (tests/test_cp_train_dist.py's bounds, the same causes: the ring and the
    reduction sum in another order): losses within 7.2e-8 relative (asserted 1e-5, the brief's
    fp32 summation order), norms 4.7e-7 (asserted 2e-6), weights as there.
A wrong divisor moves every loss and norm by a factor (counting each replica's targets cp times,
i.e. no `self.cp *` in Engine.loss_divisors, halves them); a wrong shard moves weights by
~lr = 3e-3: both far outside these bounds.

Bytes: each rank's parameters, gradients, master weights and optimizer states after the last
backward equal `lmforge plan --cp 2 --dp D --zero-stage S`'s exactly (fsdp: stage 3 with
train.parallel=fsdp, FSDP2's layout), also under bf16-mixed, fp16-mixed and LoRA, and the
data-parallel bytes one step sent equal its communication row (fsdp's traffic is torch's, not
counted).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import run_worker  # noqa: E402

from lmforge.cli import main  # noqa: E402
from lmforge.modes import get_strategy  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "cp_zero_worker.py"
SHARDED = ("zero1", "zero2", "zero3", "fsdp")
STEPS, LR, ACCUM = 3, 3e-3, 2
TP = ["parallel.tp=2"]
VARIANTS = {"bf16": ["train.precision=bf16-mixed"], "fp16": ["train.precision=fp16-mixed"],
            "lora": ["finetune.lora_rank=4"]}  # adapters on the model's own initialisation (as test_tp_zero_dist)
MIXED = ("zero1@bf16", "zero3@bf16", "fsdp@bf16", "zero2@fp16")
LORA = ("zero3@lora", "fsdp@lora")
TWO = {"one@1": [], "ddp": [], **{s: [] for s in SHARDED},
       **{f"ddp@{v}": o for v, o in VARIANTS.items()},
       **{n: VARIANTS[n.split("@")[1]] for n in (*MIXED, *LORA)}}
FOUR = {"one@2": [], "one@1": [], "ddp": [], **{s: [] for s in SHARDED},
        "ddp@tp": TP, **{f"{s}@tp": TP for s in SHARDED}}
CELLS = [(2, s) for s in SHARDED] + [(4, s) for s in SHARDED] + [(4, f"{s}@tp") for s in SHARDED]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """launches(ranks): every run of that world size, from one torchrun launch made on first use."""
    root, done = tmp_path_factory.mktemp("cp-zero"), {}

    def launch(ranks: int) -> dict:
        if ranks not in done:
            done[ranks] = run_worker(root, ranks, TWO if ranks == 2 else FOUR, WORKER)
        return done[ranks]
    return launch


def weights_differ(a: dict, b: dict) -> torch.Tensor:
    assert a.keys() == b.keys()
    return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in b])


@pytest.mark.parametrize("ranks,name", CELLS)
def test_sharded_cp_trains_as_cp_ddp_and_as_one_process(launches, ranks, name):
    runs = launches(ranks)
    ddp = runs["ddp@tp" if name.endswith("@tp") else "ddp"][0]
    per_replica = 4 if name.endswith("@tp") else 2  # cp x tp ranks
    replicas = ranks // per_replica
    for rank, result in enumerate(runs[name]):
        # rank = (dp_index cp + cp_index) tp + tp_index: the cp (and tp) ranks of a replica draw its rows
        assert (result["replicas"], result["replica"]) == (replicas, rank // per_replica), (name, rank)
        assert result["losses"] == pytest.approx(ddp["losses"], rel=1e-6), (name, rank)
        assert result["norms"] == pytest.approx(ddp["norms"], rel=1e-6), (name, rank)
        assert result["num_params"] == ddp["num_params"]
        diff = weights_differ(result["model"], ddp["model"])
        assert diff.max().item() <= 2 * STEPS * LR and (diff > 1e-6).float().mean().item() <= 1e-4, (name, rank)
        for key, state in ddp["optimizer"]["state"].items():  # the moments by name, full shapes
            for k, v in state.items():
                torch.testing.assert_close(result["optimizer"]["state"][key][k], v, rtol=0, atol=1e-6,
                                           msg=(name, rank, key, k))
        one = runs[f"one@{replicas}"][0]
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-5), (name, rank)
        assert result["norms"] == pytest.approx(one["norms"], rel=2e-6), (name, rank)
        diff = weights_differ(result["model"], one["model"])
        assert diff.max().item() <= 2 * STEPS * LR and (diff > 1e-5).float().mean().item() <= 5e-4, (name, rank)


@pytest.mark.parametrize("name", MIXED)
def test_sharded_cp_in_16_bit_mixed_precision_trains_as_cp_ddp(launches, name):
    """bf16-mixed and fp16-mixed (its loss scaler): ZeRO and FSDP compute with 16-bit working weights
    and reduce 16-bit gradients (their fp32 masters sharded with the moments), DDP with fp32 weights
    under autocast, so the two differ in the 16-bit roundings: tests/test_tp_zero_dist.py's bounds,
    losses and the first norm within 1e-3 relative (measured: bf16 4.3e-4 and 2.4e-4, fp16 1.1e-4
    and 2.8e-5; a wrong divisor moves them by a factor)."""
    ref = launches(2)["ddp@" + name.split("@")[1]][0]
    for rank, result in enumerate(launches(2)[name]):
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-3), (name, rank)
        assert result["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-3), (name, rank)


@pytest.mark.parametrize("name", LORA)
def test_sharded_cp_with_lora_trains_as_cp_ddp(launches, name):
    """LoRA: the frozen base whole on every rank (ZeRO) or sharded too (FSDP), only the adapters
    trained; fp32, the same bounds as the full model's against cp x ddp (measured: losses and
    weights identical, norms within 8.4e-8)."""
    ref = launches(2)["ddp@lora"][0]
    for rank, result in enumerate(launches(2)[name]):
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-6), (name, rank)
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-6), (name, rank)
        diff = weights_differ(result["model"], ref["model"])
        assert diff.max().item() <= 2 * STEPS * LR and (diff > 1e-6).float().mean().item() <= 1e-4, (name, rank)


@pytest.mark.parametrize("ranks,name", [*CELLS, *((2, n) for n in (*MIXED, *LORA))])
def test_state_loads_back_by_name_and_steps_on_exactly(launches, ranks, name):
    """The state by name (full tensors), loaded into an engine of another initialisation, is what
    was saved, and its next step's loss is the trained engine's, bit for bit."""
    for rank, result in enumerate(launches(ranks)[name]):
        model, optimizer = result["reloaded"]
        assert all(torch.equal(model[k], t) for k, t in result["model"].items()), (name, rank)
        for key, state in result["optimizer"]["state"].items():
            assert all(torch.equal(optimizer["state"][key][k], v) for k, v in state.items()), (name, rank, key)
        trained, reloaded = result["next_step"]
        assert trained == reloaded, (name, rank)


PLAN_ARGS = {"tp": ["--tp", "2"], "bf16": ["--precision", "bf16-mixed"], "fp16": ["--precision", "fp16-mixed"],
             "lora": ["--lora-rank", "4"]}  # each variant's settings as `lmforge plan` takes them


def plan(ranks: int, name: str, capsys) -> dict:
    strategy, _, variant = name.partition("@")
    dp = ranks // (4 if variant == "tp" else 2)
    args = ["plan", "--model", "tiny", "--cp", "2", "--dp", str(dp), "--grad-accum", str(ACCUM),
            "--zero-stage", str(get_strategy(strategy).zero_stage), *PLAN_ARGS.get(variant, []), "--json"]
    if strategy == "fsdp":  # its own layout: the policy's (fp32) shards, no 16-bit working copy kept
        args.append("train.parallel=fsdp")
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("ranks,name", [(2, "ddp"), (4, "ddp"), (4, "ddp@tp"), *CELLS,
                                        *((2, n) for n in (*MIXED, *LORA))])
def test_each_rank_holds_and_sends_what_the_plan_says(launches, ranks, name, capsys):
    planned = plan(ranks, name, capsys)
    held, sent = planned["memory"]["breakdown_bytes"], planned["communication"]["sent_bytes"]
    for rank, result in enumerate(launches(ranks)[name]):
        assert result["held"] == {k: held[k] for k in result["held"]}, (name, rank)
        if not name.startswith("fsdp"):
            assert result["sent"] == sent, (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,strategy", [(4, "zero2"), (2, "fsdp")])
def test_lmforge_train_cp2_sharded_stops_resumes_and_equals_the_straight_run(tmp_path, corpus_dir, data_dir,
                                                                             ranks, strategy):
    """`lmforge train` under torchrun, cp 2 x the strategy: the end-of-run table shows the model
    states as planned, and the run stopped at step 2 resumes from its checkpoint to the
    uninterrupted run's losses and weights, bit for bit (same world, same order)."""
    from tests.conftest import tiny_overrides
    from tests.test_distributed_train import final_weights, losses, torchrun
    from tests.test_tp_train_dist import run

    steps = 4
    overrides = [*tiny_overrides(corpus_dir, data_dir, max_steps=steps, batch_size=2, eval_interval=2,
                                 checkpoint_interval=2, log_interval=1), f"optim.decay_steps={steps + 2}",
                 "train.device=cpu", "parallel.cp=2", "train.sample_tokens=0", f"train.parallel={strategy}"]
    run(torchrun(ranks, "--model", "tiny", *overrides, "--out", "straight"), tmp_path)
    table = json.loads((tmp_path / "straight" / "summary.json").read_text())["predicted_vs_measured"]
    for row in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes"):  # the trainer's own plan
        assert table[row]["measured"] == table[row]["predicted"], (row, table[row])
    run(torchrun(ranks, "--model", "tiny", *overrides, "train.max_steps=2", "--out", "stopped"), tmp_path)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "stopped", resumed)
    run(torchrun(ranks, "--resume", str(resumed), f"train.max_steps={steps}"), tmp_path)
    straight = losses(tmp_path / "straight")
    assert [s for s, _ in losses(resumed)][-3:] == [3, 4, 4]
    assert dict(losses(resumed)) == dict(straight)
    wa, wb = final_weights(resumed), final_weights(tmp_path / "straight")
    assert all(torch.equal(wa[k], wb[k]) for k in wb)
