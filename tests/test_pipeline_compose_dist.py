"""Pipelines composed with LoRA and with ZeRO-1 over each stage's replicas (issue 26), against one
process: real processes under torchrun, gloo, the `tiny` model.

Tolerances, fp32, as tests/test_pipeline.py states them: untied and unclipped, a pipeline computes
what one process accumulating its micro-batches computes, operation for operation, so bit for bit
(checked for LoRA). Tied or clipped, the tied matrix's two parts are added once at the end and the
clipping norm is a sum over stages; with replicas, gradients are averaged as (g_0 + g_1) / 2 (ZeRO-1:
reduce-scattered) where one process takes one mean over all rows: float rounding, checked with
tests/test_pipeline.py's bound (every element within 2 K lr, at most 0.1% beyond 1e-6, losses to
1e-6 relative; ZeRO-1 against one process 0.5%, measured 0.13%: see its test, which also checks
ZeRO-1 bit for bit against the DDP replicas). A replica averaging the wrong rows, a missing average or a ZeRO shard updated from
another slice moves most weights by about lr and fails every one of these.

The bytes: tiny's units split evenly between 2 replicas (no padding), so each rank's measured
parameters, gradients, master weights and optimizer states equal the plan's per-stage bytes
exactly, and so do the bytes its replica collectives sent.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import FOUR_LAYERS, assert_same_training, pipeline, run_worker, single_process  # noqa: E402
from pipeline_worker import STEPS, config  # noqa: E402

from lmforge.accounting.plan.make import Costing, make_plan  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "pipeline_compose_worker.py"
M = 2  # micro-batches per step: few, the CPU is shared
LORA = ["finetune.lora_rank=4"]
EXACT = ["model.tie_embeddings=false", "optim.grad_clip=0"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("compose2"), 2, worker=WORKER, runs={
        "lora": pipeline(2, "1f1b", M, *LORA),
        "lora_exact": pipeline(2, "gpipe", M, *LORA, *EXACT),
    })


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """2 stages x 2 replicas."""
    return run_worker(tmp_path_factory.mktemp("compose4"), 4, worker=WORKER, runs={
        "zero1": pipeline(2, "1f1b", M, *FOUR_LAYERS, "train.parallel=zero1"),
        "zero1_exact": pipeline(2, "1f1b", M, *FOUR_LAYERS, "train.parallel=zero1", *EXACT),
        "ddp_exact": pipeline(2, "1f1b", M, *FOUR_LAYERS, "train.parallel=ddp", *EXACT),
        "zero1_lora": pipeline(2, "1f1b", M, *FOUR_LAYERS, "train.parallel=zero1", *LORA),
        "ddp_lora": pipeline(2, "1f1b", M, *FOUR_LAYERS, "train.parallel=ddp", *LORA),
    })


def test_lora_on_a_pipeline_trains_as_one_process_with_lora(two_ranks):
    assert_same_training(two_ranks["lora"], single_process(M, 1, *LORA))
    exact, reference = two_ranks["lora_exact"], single_process(M, 1, *LORA, *EXACT)
    assert exact["losses"] == reference["losses"]
    # the same names as one process's model (the adapters under the layers' canonical names), equal bits
    assert set(exact["model"]) == set(reference["model"])
    assert all(torch.equal(exact["model"][k], reference["model"][k]) for k in reference["model"])


def test_a_lora_pipeline_trains_only_the_adapters_and_resumes_by_name(two_ranks, four_ranks):
    for result in (two_ranks["lora"], four_ranks["zero1_lora"], four_ranks["ddp_lora"]):
        assert all(name.endswith((".lora_A", ".lora_B")) for names in result["trainable"].values() for name in names)
        assert all(name.endswith((".lora_A", ".lora_B")) for name in result["optimizer_names"])
        assert result["resumes_exactly"]
    # the optimizer state names every stage's adapters, in one process's order
    reference = [n for n in single_process(M, 1, *LORA)["model"] if n.endswith((".lora_A", ".lora_B"))]
    assert sorted(two_ranks["lora"]["optimizer_names"]) == sorted(reference)


def test_zero1_over_each_stages_replicas_trains_as_ddp_replicas_bit_for_bit_and_as_one_process(four_ranks):
    # untied and unclipped, ZeRO-1's reduce-scatter computes each element's (g_0 + g_1) / 2 as DDP's
    # all-reduce does, and AdamW is elementwise: the same bits
    zero1, ddp = four_ranks["zero1_exact"], four_ranks["ddp_exact"]
    assert zero1["losses"] == ddp["losses"] and set(zero1["model"]) == set(ddp["model"])
    assert all(torch.equal(zero1["model"][k], ddp["model"][k]) for k in ddp["model"])
    # tied and clipped, against one process with the global batch (both replicas' rows): the
    # losses, norms and largest difference as tests/test_pipeline.py bounds them; the share of
    # weights beyond 1e-6 measured 0.13% here (scattered elements, at most 9e-5 = lr / 30, where a
    # gradient near zero makes AdamW's first update lr * sign(g) follow the rounding), bounded by
    # 0.5%: a wrong average or shard moves most weights by about lr
    result, reference = four_ranks["zero1"], single_process(M, 2, *FOUR_LAYERS)
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    diff = torch.cat([(t - reference["model"][k]).abs().flatten() for k, t in result["model"].items()])
    assert diff.max().item() <= 2 * STEPS * 3e-3 and (diff > 1e-6).float().mean().item() <= 5e-3
    assert result["replicas_equal"]
    assert_same_training(four_ranks["zero1_lora"], single_process(M, 2, *FOUR_LAYERS, *LORA))
    assert_same_training(four_ranks["ddp_lora"], single_process(M, 2, *FOUR_LAYERS, *LORA))
    assert four_ranks["zero1"]["resumes_exactly"]


@pytest.mark.parametrize("key", ["zero1", "zero1_lora", "ddp_lora"])
def test_each_ranks_bytes_and_replica_traffic_equal_the_plans_stage(four_ranks, key):
    overrides = pipeline(2, "1f1b", M, *FOUR_LAYERS, f"train.parallel={key.split('_')[0]}",
                         *(LORA if "lora" in key else []))
    cfg = config(overrides)
    stages = make_plan(cfg, Costing(dp=2, hardware="h100-sxm"))["pipeline"]["stages_detail"]
    for (replica, stage), held in four_ranks[key]["bytes"].items():
        planned = stages[stage]["breakdown_bytes"]
        for part in ("parameters", "gradients", "master_weights", "optimizer_states"):
            assert held[part] == planned[part], (replica, stage, part)
        # ddp: each gradient all-reduced; zero1: reduce-scattered, the parameters all-gathered; LoRA: adapters only
        assert held["sent"] == pytest.approx(stages[stage]["sent_bytes_per_step"]["data_parallel"], rel=1e-12)


# -- `lmforge train` itself: a LoRA pipeline checkpoints by name and resumes ------------------------

def test_a_lora_pipeline_run_checkpoints_the_names_of_one_process_and_resumes_to_its_numbers(
        tmp_path, corpus_dir, data_dir):
    """2 stages of m = 2 micro-batches of 2 rows against one process accumulating 2 micro-batches
    of 2 rows, LoRA rank 4 on a randomly initialised base (the same seed: the same base): saved
    at step 3, resumed to 6. Tolerance: the tied head's and embedding's parts and the clipping
    norm are summed in another order (tests/test_pipeline.py): the losses agree to 1e-5, the
    adapters to 1e-5 (six steps at lr 1e-3; a wrong adapter or a lost optimizer state moves them
    by about lr)."""
    from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints
    from lmforge.runs.checkpoint.read import read_tensors
    from lmforge.runs.checkpoint.tensors import stored_tensors
    from tests.conftest import tiny_overrides
    from tests.test_distributed_train import losses, run, torchrun

    def settings(max_steps: int, *extra: str) -> list[str]:
        return ["--model", "tiny", *tiny_overrides(corpus_dir, data_dir, max_steps=max_steps, batch_size=2,
                                                   eval_interval=3, checkpoint_interval=3, log_interval=1),
                "optim.decay_steps=6", "optim.lr=1e-3", *LORA, *extra]

    one, saved = tmp_path / "one", tmp_path / "saved"
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", *settings(6, "train.grad_accum=2"),
         "--out", str(one)], tmp_path)
    piped = ["parallel.pp=2", "train.micro_batches=2"]
    run(torchrun(2, *settings(3, *piped), "--out", str(saved)), tmp_path)
    (checkpoint,) = list_checkpoints(saved)
    one_step3 = next(p for p in list_checkpoints(one) if p.name == checkpoint.name)
    for folder in ("model", "optimizer"):  # the adapters and their moments, under one process's names
        assert stored_tensors(checkpoint, folder).keys() == stored_tensors(one_step3, folder).keys()
    assert all(name.endswith((".lora_A", ".lora_B")) for name in stored_tensors(checkpoint, "model"))
    run(torchrun(2, "--resume", str(saved), "train.max_steps=6"), tmp_path)
    mine, theirs = losses(saved), losses(one)
    assert [s for s, _ in mine] == [s for s, _ in theirs]
    assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(mine, theirs)), (mine, theirs)
    a, b = read_tensors(find_checkpoint(saved)), read_tensors(find_checkpoint(one))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
