"""SGD with momentum and Lion train under DDP and ZeRO-2 as in one process: real processes under
torchrun (gloo, 2 ranks, the `tiny` model, 3 steps of 2 micro-batches), each against one process
on the same global batches (tests/optimizers_worker.py; parallel_worker's batches and loop).

Tolerance. As in tests/test_parallel_engines.py (see there): the ranks' mean of per-rank means and
one process's mean over all rows differ by float rounding of the summation order, so losses agree
to 1e-5 relative and gradient norms to 1e-5. The updates then differ by kind:
- SGD with momentum is linear in the gradients: a rounding difference of ~1e-7 relative in a
  gradient is one of ~1e-7 lr in the update, so every parameter agrees to 1e-6 absolute.
- Lion steps by lr * sign(c), as AdamW's first steps do: where c is a cancellation near zero its
  rounding can flip the sign, moving that element by 2 lr per step. Checked with the engines
  tests' bound (every element within 2 K lr, at most 1% of each tensor's elements beyond 1e-6);
  a lost reduction or a wrong shard moves most elements by lr. Measured (2-core CPU): under DDP
  30 of 164,160 elements flipped (at most 0.07% of a tensor, each by 2 lr), which moves the
  gradient norm of the step after them by 5.3e-5 relative: later norms are checked to 1e-3, the
  first (at identical weights, what checks the reduction) to 1e-5; training on other rows moves
  the first by 0.25 or more (tests/test_composition_dist.py). ZeRO-2 came out bit-identical.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from optimizers_worker import ACCUM, STEPS  # noqa: E402
from parallel_worker import ROWS, config, train  # noqa: E402

from lmforge.modes.precision import get_policy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402
from tests.test_pipeline import run_worker  # noqa: E402

pytestmark = pytest.mark.dist

RANKS = 2
WORKER = Path(__file__).parent / "optimizers_worker.py"
OPTIMIZERS = {"sgd-momentum": ["optim.name=sgd-momentum", "optim.lr=1e-2"],
              "lion": ["optim.name=lion", "optim.lr=1e-3"]}
STRATEGIES = ("ddp", "zero2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {f"{strategy}/{name}": (strategy, overrides) for strategy in STRATEGIES
            for name, overrides in OPTIMIZERS.items()}
    return run_worker(tmp_path_factory.mktemp("optimizers"), RANKS, runs, worker=WORKER)


def single_process(overrides: list[str]) -> tuple[dict, list, list]:
    """One process on the same global batches of RANKS * ROWS rows."""
    cfg = config("none", "fp32", ACCUM, overrides)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    losses, norms = train(engine, cfg, STEPS, rank=0, ranks=1, rows=RANKS * ROWS)
    return engine.model_state_dict(), losses, norms


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sgd_momentum_under_data_parallelism_equals_one_process(trained, strategy):
    result = trained[f"{strategy}/sgd-momentum"]
    assert result["optimizer"] == "SGD"
    model, losses, norms = single_process(OPTIMIZERS["sgd-momentum"])
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert set(result["model"]) == set(model)
    for name, tensor in model.items():
        torch.testing.assert_close(result["model"][name], tensor, rtol=0, atol=1e-6)
    assert any(not torch.equal(result["model"][name], trained[f"{strategy}/lion"]["model"][name]) for name in model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lion_under_data_parallelism_equals_one_process(trained, strategy):
    result = trained[f"{strategy}/lion"]
    assert result["optimizer"] == "Lion"
    model, losses, norms = single_process(OPTIMIZERS["lion"])
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert result["norms"][0] == pytest.approx(norms[0], rel=1e-5)
    assert result["norms"][1:] == pytest.approx(norms[1:], rel=1e-3)
    assert set(result["model"]) == set(model)
    for name, tensor in model.items():
        diff = (result["model"][name] - tensor).abs()
        assert diff.max().item() <= 2 * STEPS * 1e-3, name
        assert (diff > 1e-6).float().mean().item() <= 1e-2, name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_state_loads_back_by_name(trained, strategy, name):
    """What a checkpoint holds: the optimizer's own state names (SGD's momentum_buffer, Lion's
    exp_avg), full tensors by parameter name, read back into a fresh engine unchanged."""
    result = trained[f"{strategy}/{name}"]
    saved, reloaded = result["state"], result["reloaded"]
    keys = {"sgd-momentum": {"momentum_buffer"}, "lion": {"exp_avg"}}[name]
    assert {k for entry in saved["state"].values() for k in entry if k != "step"} == keys
    assert saved["state"].keys() == reloaded["state"].keys()
    for param, entry in saved["state"].items():
        for k, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(reloaded["state"][param][k])), (param, k)
