"""Interleaved 1F1B under torchrun (gloo, 2 ranks, the `tiny` model with 4 layers: 2 stages x 2
chunks of one layer, rank 0 holding layers 0 and 2, rank 1 layers 1 and 3) against one process
accumulating the same micro-batches (also with full recomputation, and 2 replicas of the pipeline
on 4 ranks), and against torch.distributed.pipelining's ScheduleInterleaved1F1B driven with the
same chunks.

Tolerances are test_pipeline.py's, for its reasons: the backwards run in micro-batch order on
every chunk, so each gradient is summed as in one process; untied and unclipped the run is
therefore bit-identical to one process (checked), tied and clipped it differs by the rounding of
summing the tied matrix's two parts once and the norm over ranks (assert_same_training's bound).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from lmforge.parallel.pipeline.schedules import interleaved_1f1b  # noqa: E402
from tests.test_pipeline import assert_same_training, pipeline, run_worker, single_process  # noqa: E402

pytestmark = pytest.mark.dist

M = 4  # micro-batches per step: two rounds of p = 2
INTERLEAVED = ["model.n_layers=4", "train.pipeline_virtual_stages=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("interleaved"), 2, {
        "interleaved": pipeline(2, "interleaved-1f1b", M, *INTERLEAVED),
        "torch": pipeline(2, "interleaved-1f1b", M, *INTERLEAVED, "train.pipeline_engine=torch"),
        "exact": pipeline(2, "interleaved-1f1b", M, *INTERLEAVED, "model.tie_embeddings=false", "optim.grad_clip=0"),
        "recompute": pipeline(2, "interleaved-1f1b", M, *INTERLEAVED, "train.recompute=full"),
    })


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    # 4 ranks = 2 stages x 2 chunks x 2 replicas: replica 1's chunks send to replica 1's ranks
    exact = ["model.n_layers=4", "train.parallel=ddp", "model.tie_embeddings=false", "optim.grad_clip=0"]
    return run_worker(tmp_path_factory.mktemp("interleaved_dp"), 4, {
        "p2_dp2": pipeline(2, "interleaved-1f1b", M, *INTERLEAVED, "train.parallel=ddp"),
        "exact": pipeline(2, "interleaved-1f1b", M, *exact, "train.pipeline_virtual_stages=2"),
        "exact_1f1b": pipeline(2, "1f1b", M, *exact),
    })


def test_interleaved_1f1b_trains_as_one_process_accumulating_the_micro_batches(runs):
    reference = single_process(M, 1, "model.n_layers=4")
    assert_same_training(runs["interleaved"], reference)
    assert_same_training(runs["torch"], reference)


def test_interleaved_with_full_recomputation_trains_as_one_process(runs):
    assert_same_training(runs["recompute"], single_process(M, 1, "model.n_layers=4", "train.recompute=full"))


def test_interleaved_replicas_train_as_one_process_on_both_replicas_rows(replicated):
    assert_same_training(replicated["p2_dp2"], single_process(M, 2, "model.n_layers=4"))
    # untied and unclipped, each parameter's gradient is the same sum as under 1F1B's replicas
    # (micro-batch order, then the two replicas'), whichever rank holds it: bit for bit
    ours, theirs = replicated["exact"], replicated["exact_1f1b"]
    assert ours["losses"] == theirs["losses"] and set(ours["model"]) == set(theirs["model"])
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in ours["model"])


def test_untied_and_unclipped_interleaved_is_bit_identical_to_one_process(runs):
    reference = single_process(M, 1, "model.n_layers=4", "model.tie_embeddings=false", "optim.grad_clip=0")
    result = runs["exact"]
    assert result["losses"] == reference["losses"]
    assert set(result["model"]) == set(reference["model"])
    assert all(torch.equal(result["model"][k], reference["model"][k]) for k in reference["model"])


def test_ours_equals_torchs_schedule_interleaved_1f1b(runs):
    # the same chunks, micro-batches and loss / m, gradients summed in micro-batch order: bit for bit
    ours, theirs = runs["interleaved"], runs["torch"]
    assert ours["losses"] == theirs["losses"]
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in ours["model"])


def test_the_activations_alive_at_once_are_the_warm_ups_chunks(runs):
    """Measured with saved-tensor hooks during the first step: the most bytes alive at once is
    what the action list keeps alive, chunk by chunk (the chunks save different bytes: rank 1's
    last holds the loss), and (micro-batch, chunk) pairs in flight are the warm-up's."""
    for stage in range(2):
        held = runs["interleaved"]["in_flight"][(0, stage)]
        actions = interleaved_1f1b(2, M, stage, 2)
        assert held["chunks"] == 2 * (2 - stage - 1) + 2 + 1  # 2 (p - s - 1) + (v - 1) p + 1
        alive = peak = 0
        for a in actions:
            alive += held["chunk_bytes"][a.chunk] * (1 if a.kind == "F" else -1)
            peak = max(peak, alive)
        assert min(held["chunk_bytes"]) > 0 and held["activation_bytes"] == peak, stage
