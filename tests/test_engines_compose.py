"""What every data-parallel engine must compose with (issue 26): a LoRA model (frozen base,
trainable adapters) and an optimizer that is not lmforge's (torch.optim.AdamW). Real processes
under torchrun, gloo, the `tiny` model; one worker launch for every strategy, compared with one
process on the same global batches as in test_parallel_engines.py (the same tolerances)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import make_engine, variant_config  # noqa: E402
from lmforge.accounting.comm import step_communication  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from test_parallel_engines import ACCUM, assert_same_training, run_worker, single_process, state_equal  # noqa: E402

pytestmark = pytest.mark.dist

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
VARIANTS = ("lora", "torch_adamw")


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    keys = [f"{s}@fp32+{v}" for v in VARIANTS for s in STRATEGIES]
    return run_worker(tmp_path_factory.mktemp("compose"), 2, ",".join(keys))


# LoRA's B starts at zero, so A's first non-zero gradient (step 2) is a product with an lr-sized
# B: small, with cancellations, where Adam's g / (|g| + eps) follows the rounding of g. Measured
# (2 ranks, every strategy, DDP included, alike): 5 of lora_A's 256 elements of a tensor differ
# from one process by more than 1e-6, at most 1.9e-6. An element counts as differing above 1e-5
# here; a wrong shard or a missing average moves them by about lr (3e-3).
ADAPTER_ATOL = 1e-5


def test_lora_trains_under_every_strategy_as_in_one_process(composed):
    lr = variant_config("none", "fp32", ACCUM, ["lora"]).optim.lr
    cfg = variant_config("none", "fp32", ACCUM, ["lora"])
    torch.manual_seed(cfg.train.seed)
    initial = {k: v.clone() for k, v in make_engine(cfg, ["lora"]).model_state_dict().items()}
    reference = single_process(2, variants=["lora"])
    adapters = {k for k in reference[0] if ".lora_" in k}
    assert adapters and all(not torch.equal(reference[0][k], initial[k]) for k in adapters if "lora_B" in k)
    for strategy in STRATEGIES:
        result = composed[f"{strategy}@fp32+lora"]
        assert_same_training(result, reference, lr, atol=ADAPTER_ATOL), strategy
        for name, tensor in result["model"].items():
            if name not in adapters:  # the frozen base: exactly as initialised
                assert torch.equal(tensor, initial[name]), (strategy, name)
        # moments for the adapters alone
        assert set(result["optimizer"]["state"]) == adapters, strategy


def test_lora_state_loads_back(composed):
    for strategy in ("ddp", "zero1", "zero3"):
        result = composed[f"{strategy}@fp32+lora"]
        model, optimizer = result["reloaded"]
        assert state_equal(model, result["model"]), strategy
        assert set(optimizer["state"]) == set(result["optimizer"]["state"]), strategy


def test_torch_adamw_in_every_strategy_equals_one_process(composed):
    lr = variant_config("none", "fp32", ACCUM, ["torch_adamw"]).optim.lr
    reference = single_process(2, variants=["torch_adamw"])
    for strategy in STRATEGIES:
        assert_same_training(composed[f"{strategy}@fp32+torch_adamw"], reference, lr), strategy


def test_lora_sends_only_the_adapters_gradients_as_the_plan_counts(composed):
    """Issue 26 part 3: under DDP and our ZeRO the bytes each rank sends per step follow the
    trainable parameters; the counted collectives equal accounting/comm.py's line exactly."""
    cfg = variant_config("none", "fp32", ACCUM, ["lora"])
    lora = (cfg.finetune.lora_rank, cfg.finetune.lora_targets)
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        held = composed[f"{strategy}@fp32+lora"]["held"]
        formula = step_communication(cfg.model, strategy, 2, get_policy("fp32"), grad_accum=ACCUM, lora=lora)
        full = step_communication(cfg.model, strategy, 2, get_policy("fp32"), grad_accum=ACCUM)
        assert held["ring"]["model"] == formula["ring_elements"] * formula["element_bytes"], strategy
        assert held["sent"] == pytest.approx(formula["sent_bytes"], rel=1e-12), strategy
        assert formula["sent_bytes"] < full["sent_bytes"] / 10, strategy  # tiny: 4-rank adapters vs all weights
