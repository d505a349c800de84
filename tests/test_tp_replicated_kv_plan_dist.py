"""The plan of a tensor-parallel run with fewer KV heads than ranks (replicated KV heads,
lmforge/parallel/tp.py: each KV head on tp / n_kv_heads ranks) against what its ranks really hold,
save and send: real processes under torchrun, gloo, the `tiny` model (4 heads, 2 KV heads), batch
4 x 64 tokens, two micro-batches a step (tests/tp_kv_plan_worker.py measures).

Every comparison is exact (==), as in tests/test_tp_accounting_dist.py: both sides count the same
tensors and the same collectives, nothing is rounded or timed. What the plan once got wrong, by the
even split over tp it assumed: at tp=4 a rank holds one KV head's k and v rows (1/2 of the
projections, not 1/4), keeps that head's k and v for backward, and all-reduces the copies'
gradients in n_kv_heads slots (the whole projections' bytes, twice: an all-reduce); by how much:
tests/test_tp_accounting.py. Measuring first found tp.py's hook keeping the whole slots buffer as
each copy's gradient (16,384 bytes over the plan at tp=4): it returns a copy of its slot now.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import run_worker  # noqa: E402
from tp_accounting_worker import BATCH, SEQ  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.accounting.comm import step_communication, tensor_parallel_communication  # noqa: E402
from lmforge.accounting.memory import model_state_bytes, sharded_layout  # noqa: E402
from lmforge.accounting.activations import activation_breakdown
from lmforge.modes import get_policy, get_strategy

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "tp_kv_plan_worker.py"
SP, MQA = "parallel.sequence_parallel=true", "model.n_kv_heads=1"
RUNS = {  # 4 ranks: tp=4 is one replica (2 copies of each KV head); tp=2 of one KV head is 2 replicas
    "tp4": ["parallel.tp=4"], "tp4+sp": ["parallel.tp=4", SP],
    "tp4@bf16": ["parallel.tp=4", "train.precision=bf16-mixed"],
    "tp4 qwen3-like": ["parallel.tp=4", "model.qk_norm=true", "model.qkv_bias=true"],
    "mqa tp2 x ddp": ["parallel.tp=2", MQA],
    "mqa tp2 x zero1": ["parallel.tp=2", MQA, "train.parallel=zero1"],
    "mqa tp2 x zero2@bf16": ["parallel.tp=2", MQA, "train.parallel=zero2", "train.precision=bf16-mixed"],
    "mqa tp2 x zero3": ["parallel.tp=2", MQA, "train.parallel=zero3"],
}


def config(overrides: list[str]):
    tp = int(next(o for o in overrides if o.startswith("parallel.tp=")).split("=")[1])
    return tp, tp_config(tp, 4, [f"train.batch_size={BATCH}", *overrides])


def planned(overrides: list[str]) -> dict:
    """What the plan says one rank holds, saves and sends (accounting/plan/make.py's calls)."""
    tp, cfg = config(overrides)
    policy, t, sp = get_policy(cfg.train.precision), cfg.train, cfg.parallel.sequence_parallel
    stage, dp = get_strategy(t.parallel).zero_stage, 4 // tp
    layout = sharded_layout(policy, stage)  # ZeRO's 16-bit working weights under bf16-mixed
    held = model_state_bytes(cfg.model, policy, cfg.optim.name, stage, dp=dp, tp=tp)
    saved = activation_breakdown(cfg.model, BATCH, SEQ, layout, tp=tp, sequence_parallel=sp)
    sent = {"tp": tensor_parallel_communication(cfg.model, BATCH, SEQ, tp, sp, layout, t.grad_accum)["sent_bytes"],
            "model": step_communication(cfg.model, t.parallel, dp, policy, t.grad_accum, tp=tp)["sent_bytes"]}
    return dict(saved=sum(saved.values()), held=held, sent=sent)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp-kv-plan"), 4, RUNS, WORKER)


@pytest.mark.parametrize("run", list(RUNS))
def test_plan_equals_measured_per_rank(four_ranks, run):
    """The engine's state_bytes, the saved bytes and the step's traffic by kind, on each of 4 ranks."""
    plan = planned(RUNS[run])
    for rank, measured in enumerate(four_ranks[run]):
        assert {k: measured[k] for k in plan} == plan, (run, rank)


def test_zero_replicas_of_replicated_kv_heads_train_as_ddp_replicas(four_ranks):
    """ZeRO keeps the module's parameters, so tp.py's hooks sum the copies' gradients before it
    shards them (ZeRO-3 too: it gathers into the same parameters): after one update the next loss
    is DDP's (fp32: the same arithmetic, as in tests/test_tp_zero_dist.py, 1e-6 relative; an engine
    that lost the hook would update k and v by half their gradient: FSDP2's new parameters do, and
    tp_engine.py sums the copies after backward instead, tests/test_sp_cp_dist.py, which breaks it).
    DDP's replicas against one process: tests/test_tp_replicated_kv_dist.py."""
    for stage in ("zero1", "zero3"):
        for ddp, zero in zip(four_ranks["mqa tp2 x ddp"], four_ranks[f"mqa tp2 x {stage}"]):
            assert zero["next_loss"] == pytest.approx(ddp["next_loss"], rel=1e-6), stage


@pytest.mark.slow
def test_lmforge_train_tp4_of_2_kv_heads_tables_as_planned(tmp_path, corpus_dir, data_dir):
    """`lmforge train --nproc 4 parallel.tp=4` of tiny (2 KV heads: each on 2 ranks): it trains, and
    the end-of-run table's tensor-parallel traffic, model states and saved bytes are predicted ==
    measured (rank 0's), as tests/test_tp_accounting_dist.py's tp=2 run."""
    import subprocess

    from tests.conftest import tiny_overrides
    from tests.test_distributed_train import env, losses, torchrun

    overrides = [*tiny_overrides(corpus_dir, data_dir, max_steps=3, eval_interval=2, checkpoint_interval=10),
                 "train.device=cpu", "train.grad_accum=2", "parallel.tp=4"]
    result = subprocess.run(torchrun(4, "--model", "tiny", *overrides, "--out", "run"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=600, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert [step for step, _ in losses(tmp_path / "run")][-1] == 3
    table = json.loads((tmp_path / "run" / "summary.json").read_text())["predicted_vs_measured"]
    for row in ("tp_sent_bytes_per_step", "parameters_bytes", "gradients_bytes", "optimizer_states_bytes",
                "activations_bytes"):
        assert table[row]["measured"] == table[row]["predicted"], (row, table[row])
