"""Tensor parallelism (parallel.tp=2) composed with what else a run sets: bf16-mixed and bf16-pure,
selective and full recomputation, LoRA (split adapters: parallel/tp_lora.py, also with sequence
parallelism), torch.compile, each on tp=2 (2 ranks) and some on tp=2 x ddp=2 (4 ranks), trained
3 steps against one process on the same global batches. One torchrun launch per world size runs
every cell (tests/tp_compose_worker.py); these are the composition matrix's tp rows
(tests/composition_coverage.py, whose COVERAGE names these tests).

Tolerances. fp32 cells: tests/test_tp_dist.py's (float rounding of the summation order; measured
losses to 7e-8 relative with recomputation and LoRA as without). Recomputation reruns f and g in
the recomputed forward: every rank reruns the same collectives in the same order, and the numbers
are bit for bit those of the run without it. 16-bit cells: tests/test_composition_dist.py's
SIXTEEN_BIT bounds (losses 1e-3, first norm 1e-3, later norms 1e-2, update error 0.15), each
several times below what training on other rows gives; here each rank's partial products are
rounded to 16 bits before g sums them, where one process rounds the whole sum once. Measured
(tp=2, bf16-mixed / bf16-pure): losses 7e-4 / 2e-4 relative, norms 1.1e-3 / 9e-4 (the worst step).
The LoRA cells train adapters on the model's own initialisation (the base's weights are loaded
into the whole model before it is split, the same path as any base: train/setup.py step 1).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import ROWS, train  # noqa: E402
from test_composition_dist import SIXTEEN_BIT, update_error  # noqa: E402
from test_pipeline import run_worker  # noqa: E402
from test_tp_dist import assert_same_training  # noqa: E402
from tp_compose_worker import STEPS, trainable_grads  # noqa: E402
from tp_worker import ACCUM  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "tp_compose_worker.py"
LORA = ["finetune.lora_rank=4", "finetune.lora_targets=q_proj,v_proj,o_proj,gate_proj,down_proj"]  # both kinds
CELLS_2 = {"bf16-mixed": ["train.precision=bf16-mixed"], "bf16-pure": ["train.precision=bf16-pure"],
           "recompute=selective": ["train.recompute=selective"], "recompute=full": ["train.recompute=full"],
           "LoRA": LORA, "LoRA+sp": [*LORA, "parallel.sequence_parallel=true"],
           "LoRA bf16-mixed": [*LORA, "train.precision=bf16-mixed"]}
CELLS_4 = {"bf16-mixed": ["train.precision=bf16-mixed"], "LoRA+recompute=full": [*LORA, "train.recompute=full"]}


def one_process(replicas: int, overrides: list[str]) -> dict:
    """The same steps in one process on the global batch of replicas * ROWS rows, and its initial weights."""
    cfg = make_config("tiny", overrides=[f"train.grad_accum={ACCUM}", "train.sample_tokens=0",
                                         *[o for o in overrides if not o.startswith("parallel.")]])
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    initial = {k: v.float().clone() for k, v in engine.model_state_dict().items()}
    held = {}
    losses, norms = train(engine, cfg, STEPS, 0, 1, rows=replicas * ROWS,
                          on_grads=lambda e: held.update(grads=trainable_grads(e.model, None)))
    return dict(losses=losses, norms=norms, model={k: v.float() for k, v in engine.model_state_dict().items()},
                initial=initial, lr=cfg.optim.lr, precision=cfg.train.precision, **held)


def assert_trains_as_one_process(name: str, result: dict, reference: dict):
    if reference["precision"] == "fp32":
        assert_same_training(result, reference, lr=reference["lr"])
    else:
        losses, first_norm, norms, update = SIXTEEN_BIT
        assert result["losses"] == pytest.approx(reference["losses"], rel=losses), name
        assert result["norms"][0] == pytest.approx(reference["norms"][0], rel=first_norm), name
        assert result["norms"] == pytest.approx(reference["norms"], rel=norms), name
        assert update_error(result["model"], reference["model"], reference["initial"]) <= update, name
    assert set(result["grads"]) == set(reference["grads"]), name  # the same parameters train
    if "lora" in name.lower():  # the base as it was: only the adapters moved
        assert all(torch.equal(t, reference["initial"][k]) for k, t in result["model"].items()
                   if ".lora_" not in k), name


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp2"), 2, CELLS_2, WORKER)


@pytest.mark.parametrize("cell", sorted(CELLS_2))
def test_tp2_composes_and_trains_as_one_process(two_ranks, cell):
    assert_trains_as_one_process(cell, two_ranks[cell], one_process(1, CELLS_2[cell]))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp2x2"), 4, CELLS_4, WORKER)


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(CELLS_4))
def test_tp2_times_ddp2_composes_and_trains_as_one_process(four_ranks, cell):
    assert_trains_as_one_process(cell, four_ranks[cell], one_process(2, CELLS_4[cell]))


@pytest.mark.slow
def test_tp2_compiled_trains_as_one_process_compiled(tmp_path):
    """Inductor compiles each block with the f/g autograd functions and their collectives inside
    (traced or at a graph break, the numbers are one compiled process's): measured losses equal to
    the last bit, norms to 4e-7 relative; slow (two inductor compiles on this CPU, ~2.5 min)."""
    result = run_worker(tmp_path, 2, {"compiled": ["train.compile=true"]}, WORKER)["compiled"]
    assert_trains_as_one_process("compiled", result, one_process(1, ["train.compile=true"]))
