"""Context parallelism (parallel.cp=2, train.parallel=ddp) composed with what else a run sets:
selective and full recomputation, LoRA, every precision policy (fp16-mixed with its loss scaler),
torch.compile; each trained 3 steps of 2 accumulated micro-batches by train/setup.py's engine on
cp=2 (2 ranks; some also on cp=2 x dp=2 and tp=2 x cp=2, 4 ranks) against one process on the same global batch,
computed on every rank (tests/cp_train_worker.py), with the bytes the ring sent equal to
accounting/cp.py's and the parameter, gradient and optimizer bytes each rank holds equal to
accounting/memory.py's `model_state_bytes`. These are the composition matrix's cp cells (tests/composition_matrix.py).

Recomputation reruns each attention core's forward (selective) or each block's (full) in
backward, and with it the ring's sends: every rank reruns the same layers in the same order, so
the recomputed ring's K/V messages pair up as the first forward's did. The rerun is the same
arithmetic, so the numbers are bit for bit those of the run without recomputation; what changes is
the forward bytes, twice (measured, equal to `context_parallel_bytes(..., recompute=mode)`).

Tolerances. fp32 cells: tests/test_cp_train_dist.py's (the ring and the dp x cp all-reduce sum in
another order than one process: measured here losses within 7.1e-8 relative, norms 2.5e-7, at most
0.0012% of the weights beyond 1e-5; compiled: losses equal, norms 1.2e-7, 0.0018% of the weights).
16-bit cells: tests/test_composition_dist.py's bounds, each several times below what training on
other rows gives (losses 1e-3, first norm 1e-3, later norms 1e-2, update error 0.15; fp8 5e-3,
3e-2, 5e-2, 0.5): here each rank rounds its shard's K/V, partial attention outputs and gradient
to 16 bits before the ring and the all-reduce combine them, where one process rounds once.
Measured (worst rank): bf16-mixed losses 2.3e-4, first norm 4.7e-4, norms 8.1e-4, update 0.068;
bf16-pure 3.6e-4, 2.3e-5, 1.7e-3, 0.070; fp16-mixed 1.7e-4, 3.6e-6, 7.5e-4, 0.024; fp8 2.3e-3,
3.4e-3, 7.0e-3, 0.27; tp x cp fp32 losses 1.4e-7, norms 1.2e-7, bf16-mixed losses 5.9e-4, first norm
4.3e-4, norms 4.8e-4, update 0.067. LoRA trains adapters on the model's own initialisation; its base must not move.

torch.compile: dynamo cannot trace the ring's point-to-point ops (graph breaks at `P2POp` and
`batch_isend_irecv`: P2P compilation is off in torch 2.13), so each compiled block runs as graphs
around an eager ring; the group loss's target count runs eagerly too (torch.compiler.disable:
traced, Collectives' call counters were guards that recompiled the loss every step, 1.5x eager's
step time instead of 0.52x: bench/cp_compile.py). The test asserts those breaks are the only ones.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import ROWS  # noqa: E402
from test_composition_dist import TOLERANCES, update_error  # noqa: E402
from test_cp_train_dist import assert_as_one_process, settings  # noqa: E402,F401 (settings: a fixture)
from test_pipeline import run_worker  # noqa: E402

from lmforge.accounting.cp import context_parallel_bytes  # noqa: E402
from lmforge.accounting.lora import lora_parameters  # noqa: E402
from lmforge.accounting.memory import model_state_bytes  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "cp_train_worker.py"
LORA = ["finetune.lora_rank=4", "finetune.lora_targets=q_proj,v_proj,o_proj,gate_proj,down_proj"]
CELLS_2 = {"recompute=selective": ["train.recompute=selective"], "recompute=full": ["train.recompute=full"],
           "LoRA": LORA, "LoRA sft29 recompute=full": [*LORA, "+sft", "seq=29", "train.recompute=full"],
           **{p: [f"train.precision={p}"] for p in ("bf16-mixed", "bf16-pure", "fp16-mixed", "fp8")}}
CELLS_4 = {"fp16-mixed": ["train.precision=fp16-mixed"], "LoRA recompute=selective": [*LORA, "train.recompute=selective"]}
TP = ["parallel.tp=2"]  # tp=2 x cp=2 on 4 ranks: one replica
CELLS_TP = {"tp x cp": TP, "tp x cp sft29": [*TP, "+sft", "seq=29"], "tp x cp bf16-mixed": [*TP, "train.precision=bf16-mixed"],
            "tp x cp LoRA recompute=full": [*TP, *LORA, "train.recompute=full"]}
# where compile is meant to stop: the ring's sends, and the group's target count (torch.compiler.disable)
EAGER_BREAKS = ("P2POp", "batch_isend_irecv", "torch.compiler.disable")


def assert_cell(name: str, overrides: list[str], case: dict) -> None:
    if case["precision"] == "fp32":
        assert_as_one_process(case)
    else:
        losses, first_norm, norms, update = TOLERANCES[case["precision"]]
        ref = case["ref"]
        assert case["losses"] == pytest.approx(ref["losses"], rel=losses), name
        assert case["norms"][0] == pytest.approx(ref["norms"][0], rel=first_norm), name
        assert case["norms"] == pytest.approx(ref["norms"], rel=norms), name
        assert update_error(case["model"], ref["model"], case["initial"]) <= update, name
        for key, tensor in case["model"].items():
            assert torch.equal(case["reloaded"][key], tensor), (name, key)
    if "LoRA" in name:  # only the adapters moved
        assert any(".lora_" in k for k in case["model"])
        assert all(torch.equal(t, case["initial"][k]) for k, t in case["model"].items() if ".lora_" not in k), name
    cfg = make_config("tiny", overrides=[o for o in overrides if o != "+sft" and not o.startswith("seq=")])
    per_micro_batch = context_parallel_bytes(cfg.model, ROWS, case["seq"], 2, get_policy(cfg.train.precision).bytes.compute,
                                             recompute=cfg.train.recompute, tp=cfg.parallel.tp)
    assert case["traffic"] == {k: case["steps"] * v for k, v in per_micro_batch.items()}, name
    # every cp rank holds the whole model (tp x cp: its tp slice) as ddp (tp x ddp) does: the plan's
    # bytes (LoRA under tp: the adapters one tensor rank holds, as tp_lora.py splits them)
    lora = (lora_parameters(cfg.model, cfg.finetune.lora_rank, cfg.finetune.lora_targets, tp=cfg.parallel.tp)
            if "LoRA" in name else None)
    plan = model_state_bytes(cfg.model, get_policy(cfg.train.precision), tp=cfg.parallel.tp, lora_trainable=lora)
    assert {k: case["held"][k] for k in plan} == plan, name


@pytest.mark.parametrize("ranks, cells", [(2, CELLS_2), (4, CELLS_4)])
def test_cp2_composes_and_trains_as_one_process(tmp_path, ranks, cells):
    results = run_worker(tmp_path, ranks, cells, WORKER)
    assert len(results) == ranks
    for result in results:
        for name, case in result.items():
            assert case["replicas"] == ranks // 2
            assert_cell(name, cells[name], case)
    # recomputation reruns the same arithmetic: bit for bit the run without it (the 2-rank cells)
    if ranks == 2:
        assert results[0]["recompute=full"]["losses"] == results[0]["recompute=selective"]["losses"]


def test_tp2_times_cp2_trains_as_one_process(tmp_path):
    """4 ranks, rank = cp_index * 2 + tp_index: each cp shard's loss is the vocabulary-parallel one
    over its tp pair, each tp rank's ring carries its own KV head (half the bytes of cp alone)."""
    results = run_worker(tmp_path, 4, CELLS_TP, WORKER)
    for rank, result in enumerate(results):
        for name, case in result.items():
            assert (case["replicas"], case["cp_rank"]) == (1, rank // 2)
            assert_cell(name, CELLS_TP[name], case)


@pytest.mark.slow
def test_cp2_compiled_trains_as_one_process_compiled(tmp_path):
    cells = {"compiled": ["train.compile=true"]}
    results = run_worker(tmp_path, 2, cells, WORKER)
    for result in results:
        case = result["compiled"]
        assert_cell("compiled", cells["compiled"], case)
        # the ring's sends and the count are where compile stops, and nothing else is
        assert case["graph_breaks"] and all(any(p in reason for p in EAGER_BREAKS) for reason in case["graph_breaks"])


@pytest.mark.slow
def test_lmforge_train_tp2_times_cp2_trains_and_resumes_in_one_process(tmp_path, settings):
    """`lmforge train` on 4 ranks, tp=2 x cp=2 (evaluation, checkpoints every 2 steps): the same train
    and validation losses as one process within 1e-5 and the same weights (test_tp_train_dist.py's
    bounds); its checkpoint (full tensors by name) resumes in one process as one process's does."""
    from tests.test_distributed_train import losses, torchrun
    from tests.test_tp_train_dist import assert_close_runs, run
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(4), "--out", "one"],
        tmp_path)
    run(torchrun(4, "--model", "tiny", *settings(4), "parallel.tp=2", "parallel.cp=2", "train.parallel=ddp",
                 "--out", "tpcp"), tmp_path)
    assert_close_runs(tmp_path / "tpcp", tmp_path / "one")
    for folder in ("tpcp", "one"):
        run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--resume", str(tmp_path / folder),
             "train.max_steps=6", "parallel.tp=1", "parallel.cp=1", "train.parallel=none"], tmp_path)
    assert [s for s, _ in losses(tmp_path / "tpcp")][-3:] == [5, 6, 6]
    assert_close_runs(tmp_path / "tpcp", tmp_path / "one", steps=6)
