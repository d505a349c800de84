"""The composition matrix's cells that no other dist test trains (tests/composition_matrix.py,
docs/composition.md): every data-parallel strategy in every precision, every kind of training
(a full fine-tune from a base, on examples whose prompts have no targets; LoRA) in every precision,
compiled, recomputed, and each strategy's state loaded back by name. The cells are the matrix's
COVERAGE entries naming this file, so the page says what runs here. One torchrun launch of 2 ranks
(gloo, the `tiny` model) trains them all, each against one process on the same global batches;
in every cell the bytes each rank holds equal the plan's (accounting/memory.py).

Tolerances. fp32: tests/test_parallel_engines.py's (float rounding of the summation order).
Below fp32 the ranks and one process do not compute the same roundings: each rank multiplies its
own rows in 16 bits, ZeRO and FSDP compute on 16-bit working weights (one process casts fp32 ones
per matmul), and fp8 takes each tensor's scale from the amax of the rows it holds. Measured
(2 ranks, 3 steps, lr 3e-3, worst over the strategies) against what training on other rows gives
(one process on another global batch: what a lost reduction does):

    figure                              16-bit  (bound)   fp8    (bound)   other rows
    losses, relative                    1.9e-4  (1e-3)    2.4e-3 (5e-3)    6e-3 - 2.7e-2
    first gradient norm, relative       3.0e-4  (1e-3)    1.3e-2 (3e-2)    0.25 - 0.41 (1.0 without / N)
    later gradient norms, relative      3.1e-3  (1e-2)    1.3e-2 (5e-2)
    update error |d - d1| / |d1|        0.077   (0.15)    0.34   (0.5)     0.89 - 1.04

where d is the change of every weight over the run and d1 one process's. The first gradient norm
is taken at identical weights, so it checks the reduction itself closely; the update error that
the step applied it (a wrong shard or a missing update moves most of d). fp8 is the widest, worst
under ZeRO on a fine-tune (zero3, fp8, full fine-tuning: the first norm 1.3e-2 off): its scales
come from each rank's rows, its gradients are E5M2 (2 mantissa bits), and Adam turns the
differences of near-zero gradients into lr-sized steps.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import make_engine, parse_key, variant_config  # noqa: E402
from test_engines_compose import ADAPTER_ATOL  # noqa: E402
from test_parallel_engines import ACCUM, assert_same_training, run_worker, single_process, state_equal  # noqa: E402

from lmforge.accounting.lora import lora_parameters  # noqa: E402
from lmforge.accounting.memory import model_state_bytes  # noqa: E402
from lmforge.modes import get_policy, get_strategy  # noqa: E402
from composition_matrix import COVERAGE, DIST  # noqa: E402

pytestmark = pytest.mark.dist

RANKS = 2
KIND_VARIANTS = {"pretraining": [], "full fine-tuning": ["sft"], "LoRA": ["lora"]}
EXTRA_VARIANTS = {None: [], "compiled": ["compile"], "recompute=selective": ["recompute_selective"],
                  "recompute=full": ["recompute_full"], "checkpoint + resume": ["reload"]}
# (losses, first norm, later norms, update error): see the docstring
SIXTEEN_BIT = (1e-3, 1e-3, 1e-2, 0.15)
TOLERANCES = {"bf16-mixed": SIXTEEN_BIT, "fp16-mixed": SIXTEEN_BIT, "bf16-pure": SIXTEEN_BIT,
              "fp8": (5e-3, 3e-2, 5e-2, 0.5)}


def keys_of(test: str) -> list[str]:
    """The worker keys of the cells COVERAGE gives `test` (a function of this file)."""
    return [f"{layout}@{precision}" + "".join(f"+{v}" for v in KIND_VARIANTS[kind] + EXTRA_VARIANTS[c.extra])
            for c in COVERAGE if c.test == DIST + test
            for layout in c.layouts for precision in c.precisions for kind in c.kinds]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    keys = sorted({key for c in COVERAGE if c.test.startswith(DIST) for key in keys_of(c.test[len(DIST):])})
    return run_worker(tmp_path_factory.mktemp("matrix"), RANKS, ",".join(keys))


@pytest.fixture(scope="module")
def references():
    """One process on the same global batches, and its initial weights, by (precision, variants)."""
    cache = {}

    def reference(precision: str, variants: list[str]):
        variants = [v for v in variants if v != "reload"]
        if (precision, *variants) not in cache:
            cfg = variant_config("none", precision, ACCUM, variants)
            torch.manual_seed(cfg.train.seed)
            initial = {k: v.clone() for k, v in make_engine(cfg, variants).model_state_dict().items()}
            cache[(precision, *variants)] = single_process(RANKS, precision, variants), initial
        return cache[(precision, *variants)]
    return reference


def update_error(model: dict, reference: dict, initial: dict) -> float:
    """|d - d1| / |d1|, d the change of every weight from `initial`, d1 the reference's."""
    off = sum(((model[k].float() - reference[k].float()) ** 2).sum() for k in reference)
    moved = sum(((reference[k].float() - initial[k].float()) ** 2).sum() for k in reference)
    return (off / moved).sqrt().item()


def assert_trains_as_one_process(key: str, result: dict, references) -> None:
    strategy, precision, variants = parse_key(key)
    (ref_model, ref_losses, ref_norms), initial = references(precision, variants)
    if precision == "fp32":
        lr = variant_config("none", precision, ACCUM, variants).optim.lr
        assert_same_training(result, (ref_model, ref_losses, ref_norms), lr,
                             atol=ADAPTER_ATOL if "lora" in variants else 1e-6)
    else:
        losses, first_norm, norms, update = TOLERANCES[precision]
        assert result["losses"] == pytest.approx(ref_losses, rel=losses), key
        assert result["norms"][0] == pytest.approx(ref_norms[0], rel=first_norm), key
        assert result["norms"] == pytest.approx(ref_norms, rel=norms), key
        assert update_error(result["model"], ref_model, initial) <= update, key
    if "lora" in variants:  # the base as it was: only the adapters train
        assert all(torch.equal(t, initial[k]) for k, t in result["model"].items() if ".lora_" not in k), key


def assert_bytes_equal_the_plan(key: str, result: dict) -> None:
    strategy, precision, variants = parse_key(key)
    cfg = variant_config(strategy, precision, ACCUM, variants)
    lora = lora_parameters(cfg.model, cfg.finetune.lora_rank, cfg.finetune.lora_targets) if "lora" in variants else None
    plan = model_state_bytes(cfg.model, get_policy(precision), zero_stage=get_strategy(strategy).zero_stage, dp=RANKS,
                             lora_trainable=lora, fully_shard=strategy == "fsdp")
    held = result["held"]
    assert {k: held[k] for k in plan} == plan, key


def check(test: str, cells, references) -> None:
    keys = keys_of(test)
    assert keys
    for key in keys:
        assert_trains_as_one_process(key, cells[key], references)
        assert_bytes_equal_the_plan(key, cells[key])


def test_every_strategy_trains_in_every_precision_as_one_process(cells, references):
    check("test_every_strategy_trains_in_every_precision_as_one_process", cells, references)


def test_every_kind_trains_as_one_process(cells, references):
    check("test_every_kind_trains_as_one_process", cells, references)


def test_compiled_and_recomputed_engines_train_as_one_process(cells, references):
    check("test_compiled_and_recomputed_engines_train_as_one_process", cells, references)


def test_every_strategys_state_loads_back_by_name(cells, references):
    test = "test_every_strategys_state_loads_back_by_name"
    check(test, cells, references)
    for key in keys_of(test):
        model, optimizer = cells[key]["reloaded"]
        assert state_equal(model, cells[key]["model"]), key
        saved = cells[key]["optimizer"]
        assert set(optimizer["state"]) == set(saved["state"]), key
        for name, state in saved["state"].items():
            assert all(torch.equal(state[k], optimizer["state"][name][k]) for k in state), (key, name)
