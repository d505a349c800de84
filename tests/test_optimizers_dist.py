"""The element-wise optimizers (SGD with momentum, Lion, AdaGrad, RMSProp, Adam) train under every
data-parallel strategy (ddp, zero1, zero2, zero3, fsdp), with LoRA (zero3, fsdp), on a pipeline of
2 stages and on 2 stages x 2 ZeRO-1 replicas, each as one process does on the same global batches;
Muon on those pipelines too; each state loads back by name; and the bytes Muon's ZeRO gather sends
are the plan's (accounting/comm.py). Real processes under torchrun (gloo, the `tiny` model, 3
steps of 2 micro-batches): one launch of 2 ranks (data-parallel runs, tests/optimizers_worker.py,
and the 2-stage pipelines, tests/pipeline_compose_worker.py's runs) and one of 4 (the replicas).

Tolerance, data parallelism. As in tests/test_parallel_engines.py (see there): the ranks' mean of
per-rank means and one process's mean over all rows differ by float rounding of the summation
order, so losses agree to 1e-5 relative and the first gradient norm (at identical weights: what
checks the reduction) to 1e-5. The updates then differ by kind:
- SGD with momentum is linear in the gradients: a rounding difference of ~1e-7 relative in a
  gradient is one of ~1e-7 lr in the update, so every parameter agrees to 1e-6 absolute.
- Lion steps by lr * sign(c), and Adam, AdaGrad and RMSProp's first steps are lr * g / sqrt(g^2)
  = lr * sign(g) (later ones close to it): where the sign's argument is a cancellation near zero
  its rounding can flip it, moving that element by up to 2 lr per step; where a later step's
  gradient is near zero too, g / sqrt(v) moves by a fraction of lr (not a flip). Checked: every
  element within 2 K lr, at most 1% of each tensor's elements beyond lr / 100; a lost reduction or
  a wrong shard moves most elements by about lr (the sign of half the rows' gradient). Not the
  engines tests' 1e-6 for that 1%: with LoRA, an element of B off by such a fraction changes the
  gradient of A's whole column that multiplies it. Measured (2 ranks, 2-core CPU): AdaGrad,
  zero3 + LoRA, 0.8% of v_proj's B off by 3.4e-5 (lr / 300), 10% of its A off by 1.4e-6 (median)
  to 1e-5 (lr / 1000); without LoRA, at most 4.8e-6 (AdaGrad), 7.4e-6 (RMSProp), 5.2e-7 (Adam),
  and Lion 2e-3 (ddp, fsdp: a few flips; the ZeRO runs bit-identical). The flips move later
  gradient norms: checked to 1e-3.
Pipelines: tests/test_pipeline.py's `assert_same_training` (fp32: the tied matrix's two parts and
the clipping norm summed in another order), the state bytes of each rank the plan's, and the state
reloaded by name stepping on bit for bit; Muon with tests/test_muon_dist.py's BOUND (its bf16
Newton-Schulz spreads a rounding difference over the whole matrix: see there).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from optimizers_worker import ACCUM, STEPS  # noqa: E402
from parallel_worker import ROWS, config, train  # noqa: E402
from test_muon_dist import BOUND  # noqa: E402
from test_pipeline import assert_same_training, pipeline, run_worker  # noqa: E402
from test_pipeline import single_process as pipeline_single_process  # noqa: E402
from test_pipeline_cells_dist import assert_bytes_equal_the_plan  # noqa: E402

from pipeline_worker import config as pipeline_config  # noqa: E402

from lmforge.accounting.comm import step_communication  # noqa: E402
from lmforge.accounting.plan.make import Costing, make_plan  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "optimizers_worker.py"
OPTIMIZERS = {"sgd-momentum": ["optim.name=sgd-momentum", "optim.lr=1e-2"],
              "lion": ["optim.name=lion", "optim.lr=1e-3"],
              "adagrad": ["optim.name=adagrad", "optim.lr=1e-2"],
              "rmsprop": ["optim.name=rmsprop", "optim.lr=1e-3"],
              "adam": ["optim.name=adam", "optim.lr=1e-3"]}
STATE_KEYS = {"sgd-momentum": {"momentum_buffer"}, "lion": {"exp_avg"}, "adagrad": {"sum"},
              "rmsprop": {"square_avg"}, "adam": {"exp_avg", "exp_avg_sq"}}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
LORA = ["finetune.lora_rank=4"]
LORA_STRATEGIES = ("zero3", "fsdp")
M, PIPELINE_LR = 2, 3e-3  # micro-batches per pipeline step; pipeline_worker.py's lr
PIPELINES = {"pipeline": (2, []), "pipeline x zero1": (4, ["train.parallel=zero1"])}  # ranks, overrides
PIPELINE_OPTIMIZERS = (*OPTIMIZERS, "muon")
MUON_GATHERS = {"zero1": "fp32", "zero3": "fp32", "zero2": "bf16-mixed"}  # strategy -> precision


def runs(ranks: int) -> dict:
    """key -> (strategy, overrides) for the worker: the data-parallel runs on 2 ranks, the pipelines'."""
    out = {}
    if ranks == 2:
        out.update({f"{s}/{n}": (s, o) for s in STRATEGIES for n, o in OPTIMIZERS.items()})
        out.update({f"{s}+lora/{n}": (s, [*o, *LORA]) for s in LORA_STRATEGIES for n, o in OPTIMIZERS.items()})
        out.update({f"{s}/muon@{p}": (s, ["optim.name=muon", f"train.precision={p}"])
                    for s, p in MUON_GATHERS.items()})
    for layout, (r, extra) in PIPELINES.items():
        if r == ranks:
            out.update({f"{layout}/{n}": ("pipeline", pipeline_overrides(layout, n)) for n in PIPELINE_OPTIMIZERS})
    return out


def pipeline_overrides(layout: str, name: str) -> list[str]:
    return pipeline(2, "1f1b", M, f"optim.name={name}", *PIPELINES[layout][1])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("optimizers2"), 2, runs(2), worker=WORKER)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("optimizers4"), 4, runs(4), worker=WORKER)


def single_process(overrides: list[str]) -> tuple[dict, list, list]:
    """One process on the same global batches of 2 * ROWS rows."""
    cfg = config("none", "fp32", ACCUM, overrides)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    losses, norms = train(engine, cfg, STEPS, rank=0, ranks=1, rows=2 * ROWS)
    return engine.model_state_dict(), losses, norms


def assert_trains_as_one_process(result: dict, name: str, overrides: list[str]) -> float:
    """The bounds of the module docstring; returns the largest parameter difference (for the docs)."""
    model, losses, norms = single_process(overrides)
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert result["norms"][0] == pytest.approx(norms[0], rel=1e-5)
    assert result["norms"][1:] == pytest.approx(norms[1:], rel=1e-3 if name != "sgd-momentum" else 1e-5)
    assert set(result["model"]) == set(model)
    lr, worst = float(overrides[1].split("=")[1]), 0.0
    for key, tensor in model.items():
        diff = (result["model"][key] - tensor).abs()
        worst = max(worst, diff.max().item())
        if name == "sgd-momentum":
            torch.testing.assert_close(result["model"][key], tensor, rtol=0, atol=1e-6)
        else:
            assert diff.max().item() <= 2 * STEPS * lr, key
            assert (diff > lr / 100).float().mean().item() <= 1e-2, key
    return worst


@pytest.mark.parametrize("strategy", [*STRATEGIES, *(f"{s}+lora" for s in LORA_STRATEGIES)])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_elementwise_optimizer_under_data_parallelism_equals_one_process(two_ranks, strategy, name):
    result = two_ranks[f"{strategy}/{name}"]
    overrides = [*OPTIMIZERS[name], *(LORA if strategy.endswith("+lora") else [])]
    worst = assert_trains_as_one_process(result, name, overrides)
    print(f"{strategy}/{name}: max |diff| {worst:.2e}")
    if strategy.endswith("+lora"):  # only the adapters moved: the base is where it started in both
        assert any(k.endswith(".lora_B") for k in result["model"])


@pytest.mark.parametrize("strategy", [*STRATEGIES, *(f"{s}+lora" for s in LORA_STRATEGIES)])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_state_loads_back_by_name(two_ranks, strategy, name):
    """What a checkpoint holds: the optimizer's own state names (SGD's momentum_buffer, AdaGrad's
    sum, ...), full tensors by parameter name (FSDP: torch's get_optimizer_state_dict), read back
    into a fresh engine unchanged."""
    result = two_ranks[f"{strategy}/{name}"]
    saved, reloaded = result["state"], result["reloaded"]
    assert {k for entry in saved["state"].values() for k in entry if k != "step"} == STATE_KEYS[name]
    assert saved["state"].keys() == reloaded["state"].keys() and saved["state"]
    for param, entry in saved["state"].items():
        for k, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(reloaded["state"][param][k])), (param, k)


@pytest.mark.parametrize("layout", PIPELINES)
@pytest.mark.parametrize("name", PIPELINE_OPTIMIZERS)
def test_each_optimizer_on_a_pipeline_trains_as_one_process(two_ranks, four_ranks, layout, name):
    """Each rank's states the plan's (Muon's: a momentum per hidden matrix element of its stage),
    the state reloaded by name stepping on bit for bit."""
    ranks = PIPELINES[layout][0]
    result = (two_ranks if ranks == 2 else four_ranks)[f"{layout}/{name}"]
    reference = pipeline_single_process(M, ranks // 2, f"optim.name={name}")
    if name == "muon":
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert result["norms"][0] == pytest.approx(reference["norms"][0], rel=1e-5)
        worst = max((result["model"][k] - reference["model"][k]).abs().max().item() for k in result["model"])
        print(f"{layout}/muon: max |diff| {worst:.2e}")
        assert worst <= BOUND and result["replicas_equal"]
    else:
        assert_same_training(result, reference, lr=PIPELINE_LR)
    if name == "muon" and ranks > 2:
        assert_muon_bytes_equal_the_plan_over_replicas(result, pipeline_overrides(layout, name), ranks // 2)
    else:
        assert_bytes_equal_the_plan(name, result, pipeline_overrides(layout, name), ranks // 2)
    assert result["resumes_exactly"]


def assert_muon_bytes_equal_the_plan_over_replicas(result: dict, overrides: list[str], replicas: int) -> None:
    """ZeRO-1 over a stage's replicas: each rank's parameters, gradients and master weights are the
    plan's, and the stage's optimizer states over its replicas are replicas x the plan's per-rank
    figure (not each rank's, below), and each rank's bytes sent, its Muon gather included, the
    plan's. Not each rank's states: Muon keeps 1 state per matrix element and AdamW 2 per other element,
    and where the shard boundary falls decides each rank's mix (measured: +-256 bytes, the 64
    elements of a norm gain, on the tiny model), while the plan gives the mean."""
    cfg = pipeline_config(overrides)
    stages = make_plan(cfg, Costing(dp=replicas, hardware="h100-sxm"))["pipeline"]["stages_detail"]
    total = {}
    for (replica, stage), held in result["bytes"].items():
        planned = stages[stage]["breakdown_bytes"]
        for part in ("parameters", "gradients", "master_weights"):
            assert held[part] == planned[part], (replica, stage, part)
        total[stage] = total.get(stage, 0) + held["optimizer_states"]
        # the bytes sent in the first step: ZeRO-1's, plus Muon's gather of the stage's blocks
        assert held["sent_optimizer"] > 0
        assert held["sent"] + held["sent_optimizer"] == stages[stage]["sent_bytes_per_step"]["data_parallel"]
    assert total == {stage: replicas * stages[stage]["breakdown_bytes"]["optimizer_states"] for stage in total}


@pytest.mark.parametrize("strategy", MUON_GATHERS)
def test_muons_zero_gather_sends_what_the_plan_counts(two_ranks, strategy):
    """ZeRO all-gathers each block's Muon update before Newton-Schulz (parallel/whole_matrices.py,
    kind "optimizer"): the plan's step_communication counts it, so its bytes sent per step are
    the measured total, exactly (model traffic and the gather apart, and together)."""
    precision = MUON_GATHERS[strategy]
    sent = two_ranks[f"{strategy}/muon@{precision}"]["sent"]
    cfg = config(strategy, precision, ACCUM, ["optim.name=muon", f"train.precision={precision}"])
    plan = step_communication(cfg.model, strategy, 2, get_policy(precision), grad_accum=ACCUM, optimizer="muon")
    assert sent["optimizer"] == plan["optimizer_sent_bytes"] > 0
    assert sent["model"] + sent["optimizer"] == plan["sent_bytes"]
    without = step_communication(cfg.model, strategy, 2, get_policy(precision), grad_accum=ACCUM)
    assert without["sent_bytes"] == sent["model"]
