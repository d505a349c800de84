"""Muon (optim/muon.py) under torchrun: DDP keeps whole matrices; ZeRO gathers each block's Muon
updates before Newton-Schulz (parallel/whole_matrices.py). Against one process on the same global
batches (tests/parallel_worker.py, its `muon` variant), and its state by name reloaded.

Tolerance. The gradients agree with one process's to float rounding of the summation order (~1e-7
relative: the first loss and the gradient norms are checked to 1e-5 and 1e-4). Newton-Schulz then
runs in bf16, where such a difference can round an input element the other way, and five
iterations of matrix products spread that over the matrix: measured, a 1e-7 relative perturbation
of a 192 x 64 input changes the bf16 output by up to 6.3e-3 (elements up to 0.28), i.e. up to
0.02 x sqrt(3) x 6.3e-3 = 2.2e-4 of a parameter per step, and more once the parameters (so the
next gradients) have drifted apart. So every element of a Muon matrix may differ a little, not
a few by much (AdamW's case in tests/test_parallel_engines.py). Measured (2 ranks, 3 steps, fp32,
2-core CPU): max |diff| 9.6e-4 (ddp), 8.4e-4 (zero1, zero3); with the gather skipped (each rank
orthogonalising its piece with the rest of the matrix zero) 1.1e-2. The bound checked, 3e-3, sits
between them; the parameters moved by up to 2.3e-2 (checked: more than 5x the bound).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_engines import STEPS, run_worker, single_process  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.dist

STRATEGIES = ("ddp", "zero1", "zero3")
BOUND = 3e-3  # see the module docstring


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One torchrun launch for both tests: Muon under each strategy, Adafactor under ddp."""
    keys = [f"{s}@fp32+muon" for s in STRATEGIES] + ["zero2@bf16-mixed+muon+reload", "ddp@fp32+adafactor"]
    return run_worker(tmp_path_factory.mktemp("muon"), 2, ",".join(keys))


def test_muon_trains_under_ddp_and_zero_as_in_one_process(results):
    ref_model, ref_losses, ref_norms = single_process(2, variants=["muon"])
    cfg = make_config("tiny")
    torch.manual_seed(cfg.train.seed)  # the runs' initial model (parallel_worker, single_process)
    model = Transformer(cfg.model)
    for strategy in STRATEGIES:
        result = results[f"{strategy}@fp32+muon"]
        # the first step's loss and every gradient norm: the same gradients, to summation order
        assert result["losses"][0] == pytest.approx(ref_losses[0], rel=1e-5), strategy
        assert result["norms"] == pytest.approx(ref_norms, rel=1e-4), strategy
        diffs = {k: (result["model"][k] - ref_model[k]).abs().max().item() for k in ref_model}
        assert max(diffs.values()) <= BOUND, (strategy, max(diffs.items(), key=lambda kv: kv[1]))
        # the parameters moved by Muon steps (~lr each), far more than they differ
        moved = result["model"]["blocks.0.mlp.up_proj.weight"] - model.state_dict()["blocks.0.mlp.up_proj.weight"]
        assert moved.abs().max().item() > 5 * BOUND
        state = result["optimizer"]["state"]
        assert state["blocks.0.mlp.up_proj.weight"].keys() == {"momentum_buffer"}
        assert state["tok_embeddings.weight"].keys() == {"step", "exp_avg", "exp_avg_sq"}
        # reloaded into a fresh engine: the same full state by name, bit for bit
        assert_reloaded(result, strategy)
    # ZeRO's extra traffic: one all-gather per step of each block's fp32 buffer (padded to 2 ranks)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks.values()]
    gathered = sum(4 * (n + n % 2) for n in blocks)
    for strategy in ("zero1", "zero3"):
        assert results[f"{strategy}@fp32+muon"]["held"]["ring"]["optimizer"] == gathered
    assert "optimizer" not in (results["ddp@fp32+muon"]["held"]["ring"] or {})


def assert_reloaded(result: dict, where: str) -> None:
    """The state by name, loaded into a fresh engine and read back, is the same bit for bit."""
    reloaded_model, reloaded_optimizer = result["reloaded"]
    for name, tensor in result["model"].items():
        assert torch.equal(reloaded_model[name], tensor), (where, name)
    for name, per_param in result["optimizer"]["state"].items():
        for key, tensor in per_param.items():
            assert torch.equal(reloaded_optimizer["state"][name][key], tensor), (where, name, key)


def test_muon_under_zero2_with_fp32_master_shards(results):
    """bf16-mixed: 16-bit working parameters and gradients (so bf16 reductions, whose rounding
    Newton-Schulz spreads further: measured max |diff| to one process 1.0e-2 after 3 steps, as
    large as a real error, so the parameters are not compared), fp32 master shards that Muon
    updates. What is checked: the gradients (norms within 1e-2 relative, measured 4e-3), the
    losses (1e-3, measured 1e-4), the gather of the fp32 master dtype (4 bytes an element, as under
    fp32), the state reloaded bit for bit."""
    result = results["zero2@bf16-mixed+muon+reload"]
    _, ref_losses, ref_norms = single_process(2, "bf16-mixed", variants=["muon"])
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-3)
    assert result["norms"] == pytest.approx(ref_norms, rel=1e-2)
    assert result["held"]["ring"]["optimizer"] == results["zero1@fp32+muon"]["held"]["ring"]["optimizer"]
    assert result["optimizer"]["state"]["blocks.1.attn.o_proj.weight"]["momentum_buffer"].dtype == torch.float32
    assert_reloaded(result, "zero2@bf16-mixed")


def test_adafactor_trains_under_ddp_as_in_one_process(results):
    """Adafactor's update is G / sqrt(V) with V a product of row and column means (never one
    element's own near-zero moment, where Adam's sign flips come from), clipped by its RMS, all in
    fp32: the summation-order difference of the gradients stays at rounding level. Measured: max
    |diff| 1.2e-7 after 3 steps, one fp32 ulp of a norm gain at 1.0; checked 1e-6. The update does
    not see the gradient's scale (a missing / N: the gradient norms catch it), but a rank left on
    its own gradient moves elements by about alpha = lr x RMS(X) ~ 6e-5 a step."""
    result = results["ddp@fp32+adafactor"]
    ref_model, ref_losses, ref_norms = single_process(2, variants=["adafactor"])
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert result["norms"] == pytest.approx(ref_norms, rel=1e-5)
    worst = max((result["model"][k] - ref_model[k]).abs().max().item() for k in ref_model)
    assert worst <= 1e-6
    assert result["optimizer"]["state"]["tok_embeddings.weight"].keys() == {"step", "row_var", "col_var"}
