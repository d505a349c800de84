"""One device mesh: 4 ranks as 2 data-parallel replicas x parallel.tp=2, the replicas sharded by
ZeRO-1/2/3 (parallel/zero.py) and FSDP2 (parallel/fsdp.py) over the dp group, each tp rank's local
shards over its dp peers (parallel/tp_engine.py). Real processes under torchrun, gloo, the `tiny`
model; tests/tp_zero_worker.py trains every strategy in one launch on parallel_worker's global
batches and the reference is the same mesh under train.parallel=ddp, same seed.

Tolerances, fp32. ZeRO: the same arithmetic as DDP. Each gradient element is the sum of the same
two replica values (a + b == b + a: two ranks leave no order to differ), divided by 2, and AdamW is
elementwise, so the pieces get the updates of the whole tensors; only the global norm sums its
squares in another grouping (pieces, not tensors), which moves the clip factor by an ulp at most.
Measured: losses, norms and final weights identical (0.0) to DDP's; asserted: losses and norms to
1e-6 relative, weights to 1e-6 absolute (an ulp-level clip difference over 3 steps at lr 3e-3 is
far below that; a wrong shard or a missed tp sum moves weights by ~lr = 3e-3). Broken on purpose:
the norm summing the whole parameters' squares over the tp ranks too (counted twice) moved the
norms by 2.6e-3 relative and the weights by 1.9e-6 (AdamW barely sees the clip factor): caught. FSDP2: its reduce-scatter divides by the
world before or after summing as torch chooses (pre/post-divide factors), so each gradient is
within an ulp or two of DDP's; measured: losses to 8e-8 relative, weights to 1.1e-7; asserted:
losses and norms 1e-6 relative, weights 1e-6 absolute, the same margins.

Bytes: each rank's parameters, gradients, master weights and optimizer states after the last
backward equal `lmforge plan --tp 2 --dp 2 --zero-stage S`'s exactly (==: both count the same
tensors; nothing is rounded), and the data-parallel bytes one step sends equal accounting/comm.py's.
With LoRA too: the plan counts the adapters one tensor rank holds (accounting/lora.py's
lora_parameters with tp), A whole on column-parallel layers and B whole on row-parallel ones, as
tp_lora.py splits them (an even split by tp, as the plan once assumed, was 4,096 bytes short).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import run_worker  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.accounting.comm import step_communication  # noqa: E402
from lmforge.accounting.lora import lora_parameters  # noqa: E402
from lmforge.accounting.memory import model_state_bytes  # noqa: E402
from lmforge.cli import main  # noqa: E402
from lmforge.modes import get_policy, get_strategy

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "tp_zero_worker.py"
SP = ["parallel.sequence_parallel=true"]
SHARDED = ("zero1", "zero2", "zero3", "fsdp")
BF16 = ["train.precision=bf16-mixed"]
BF16_SHARDED = ("zero1@bf16", "zero3@bf16", "fsdp@bf16")
LORA = ["finetune.lora_rank=4"]  # adapters trained on the model's own initialisation (as test_tp_compose_dist)
RUNS = {"ddp": [], **{s: [] for s in SHARDED}, "ddp@sp": SP, "zero3@sp": SP, "fsdp@sp": SP,
        "ddp@lora": LORA, "zero3@lora": LORA, "fsdp@lora": LORA,
        "ddp@bf16": BF16, **{s: BF16 for s in BF16_SHARDED}}
FP32 = [n for n in RUNS if not n.startswith("ddp") and not n.endswith("@bf16")]
RTOL, ATOL = 1e-6, 1e-6  # the module docstring says why


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp-zero"), 4, RUNS, WORKER)


def reference_of(name: str) -> str:
    return "ddp@" + name.split("@")[1] if "@" in name else "ddp"


@pytest.mark.parametrize("name", FP32)
def test_sharded_replicas_of_a_tp_model_train_as_ddp_replicas(four_ranks, name):
    ref = four_ranks[reference_of(name)][0]
    for rank, result in enumerate(four_ranks[name]):
        assert result["losses"] == pytest.approx(ref["losses"], rel=RTOL), (name, rank)
        assert result["norms"] == pytest.approx(ref["norms"], rel=RTOL), (name, rank)
        assert result["num_params"] == ref["num_params"]
        assert result["model"].keys() == ref["model"].keys()
        for key, tensor in ref["model"].items():  # full tensors by name, on every rank
            torch.testing.assert_close(result["model"][key], tensor, rtol=0, atol=ATOL, msg=(name, rank, key))
        # the optimizer's moments, gathered over dp and tp, are DDP's (by name, full shapes)
        for key, state in ref["optimizer"]["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(result["optimizer"]["state"][key][k], v, rtol=0, atol=ATOL,
                                           msg=(name, rank, key, k))


@pytest.mark.parametrize("name", BF16_SHARDED)
def test_sharded_replicas_in_bf16_mixed_train_as_ddp_replicas_and_hold_the_fp32_masters_as_planned(four_ranks, name):
    """bf16-mixed: ZeRO and FSDP compute with 16-bit working weights and reduce 16-bit gradients
    (the ZeRO paper's layout; their fp32 masters sharded with the moments), DDP with fp32 weights
    under autocast, so the arithmetic differs in the 16-bit roundings: tests/test_composition_dist.py's
    16-bit bounds, losses and the first norm within 1e-3 relative (measured 3e-4 and 6e-4; a missed
    tp sum or a wrong shard moves them in the second digit). The sharded strategies round alike:
    zero1, zero3 and fsdp give the same losses (measured: identical). Bytes: == the plan's."""
    ref = four_ranks["ddp@bf16"][0]
    plan = model_state_bytes(tp_config(2, 4).model, get_policy("bf16-mixed"), "adamw",
                             get_strategy(name.split("@")[0]).zero_stage, dp=2, tp=2, fully_shard=name.startswith("fsdp"))
    for rank, result in enumerate(four_ranks[name]):
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-3), (name, rank)
        assert result["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-3), (name, rank)
        assert result["losses"] == pytest.approx(four_ranks["zero1@bf16"][0]["losses"], rel=RTOL), (name, rank)
        assert result["held"] == {k: plan[k] for k in result["held"]}, (name, rank)


@pytest.mark.parametrize("name", [*FP32, *BF16_SHARDED])
def test_state_loads_back_into_a_fresh_engine_and_steps_on_exactly(four_ranks, name):
    """A checkpoint's contents (model and optimizer by name, full tensors) loaded into an engine of
    another initialisation are what was saved, and its next step's loss is the trained engine's."""
    for rank, result in enumerate(four_ranks[name]):
        model, optimizer = result["reloaded"]
        assert all(torch.equal(model[k], t) for k, t in result["model"].items()), (name, rank)
        for key, state in result["optimizer"]["state"].items():
            assert all(torch.equal(optimizer["state"][key][k], v) for k, v in state.items()), (name, rank, key)
        trained, reloaded = result["next_step"]
        assert trained == reloaded, (name, rank)


@pytest.mark.parametrize("name", ["ddp@lora", "zero3@lora", "fsdp@lora"])
def test_each_rank_holds_the_adapters_the_plan_says(four_ranks, name):
    cfg = tp_config(2, 4, LORA)
    strategy = name.split("@")[0]
    adapters = lora_parameters(cfg.model, cfg.finetune.lora_rank, cfg.finetune.lora_targets, tp=2)
    assert adapters != lora_parameters(cfg.model, cfg.finetune.lora_rank, cfg.finetune.lora_targets) / 2
    plan = model_state_bytes(cfg.model, get_policy("fp32"), "adamw", get_strategy(strategy).zero_stage, dp=2, tp=2,
                             lora_trainable=adapters, fully_shard=strategy == "fsdp")
    for rank, result in enumerate(four_ranks[name]):
        assert result["held"] == {k: plan[k] for k in result["held"]}, (name, rank)


def plan_bytes(strategy: str, capsys) -> dict:
    stage = get_strategy(strategy).zero_stage
    assert main(["plan", "--model", "tiny", "--tp", "2", "--dp", "2", "--zero-stage", str(stage), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["memory"]["breakdown_bytes"]


@pytest.mark.parametrize("name", ["ddp", *SHARDED])
def test_each_rank_holds_and_sends_what_the_plan_says(four_ranks, name, capsys):
    """FSDP2 shards like ZeRO-3 (fp32: the same bytes); its traffic is torch's, not counted here."""
    plan = plan_bytes(name, capsys)
    cfg = tp_config(2, 4, [f"train.parallel={name}"])
    sent = step_communication(cfg.model, name, 2, get_policy("fp32"), cfg.train.grad_accum, tp=2)["sent_bytes"]
    for rank, result in enumerate(four_ranks[name]):
        assert result["held"] == {k: plan[k] for k in result["held"]}, (name, rank)
        if name != "fsdp":
            assert result["sent"] == sent, (name, rank)


@pytest.mark.slow
def test_lmforge_train_tp2_zero2_on_4_ranks_resumes_exactly(tmp_path, corpus_dir, data_dir):
    """`lmforge train` under torchrun: a tp=2 x zero2 run's end-of-run table shows its model states
    as planned, and the run stopped at step 2 resumes from its checkpoint to the uninterrupted
    run's losses and weights, bit for bit (same world, same order)."""
    from tests.conftest import tiny_overrides
    from tests.test_distributed_train import final_weights, losses
    from tests.test_tp_train_dist import run
    from tests.test_distributed_train import torchrun

    steps = 4
    overrides = [*tiny_overrides(corpus_dir, data_dir, max_steps=steps, batch_size=2, eval_interval=2,
                                 checkpoint_interval=2, log_interval=1), f"optim.decay_steps={steps + 2}",
                 "train.device=cpu", "parallel.tp=2", "train.parallel=zero2"]
    run(torchrun(4, "--model", "tiny", *overrides, "--out", "straight"), tmp_path)
    table = json.loads((tmp_path / "straight" / "summary.json").read_text())["predicted_vs_measured"]
    for row in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes"):  # the trainer's own plan
        assert table[row]["measured"] == table[row]["predicted"], (row, table[row])
    run(torchrun(4, "--model", "tiny", *overrides, "train.max_steps=2", "--out", "stopped"), tmp_path)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "stopped", resumed)
    run(torchrun(4, "--resume", str(resumed), f"train.max_steps={steps}"), tmp_path)
    straight = losses(tmp_path / "straight")
    assert [s for s, _ in losses(resumed)][-3:] == [3, 4, 4]
    assert dict(losses(resumed)) == dict(straight)
    wa, wb = final_weights(resumed), final_weights(tmp_path / "straight")
    assert all(torch.equal(wa[k], wb[k]) for k in wb)
