"""`lmforge train` on a pipeline under torchrun: real processes on gloo, the `tiny` model.

A pipeline of 2 stages with 3 micro-batches of 2 sequences trains as one process accumulating 3
micro-batches of 2 (train.grad_accum=3), checkpoints by name, and resumes in one process and back;
its run folder holds the timeline picture and trace; a killed stage stops the other with one line.
Tolerance as in tests/test_pipeline.py: the tied embedding's two parts and the clip norm are summed
in another order, so weights and losses agree to float rounding (1e-5), not bit for bit."""

import json
import shutil
import sys

import pytest

from tests.test_distributed_train import (STEPS, assert_close_runs, kill_rank_after_first_checkpoint, run,  # noqa: F401
                                          settings, torchrun)

pytestmark = pytest.mark.dist

PIPELINE = ["parallel.pp=2", "train.micro_batches=3"]


@pytest.fixture(scope="module")
def accumulating(tmp_path_factory, settings):
    """The reference: one process, 3 micro-batches of 2 per step."""
    cwd = tmp_path_factory.mktemp("accumulating")
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(2),
         "train.grad_accum=3", "--out", "run"], cwd)
    return cwd / "run"


def test_a_pipeline_run_trains_as_one_process_and_draws_its_timeline(tmp_path, settings, accumulating):
    result = run(torchrun(2, "--model", "tiny", *settings(2), *PIPELINE, "train.schedule=gpipe", "--out", "run"),
                 tmp_path)
    run_dir = tmp_path / "run"
    assert_close_runs(run_dir, accumulating, atol=1e-5)
    assert result.stdout.count("lmforge train: summary") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_trained"] == STEPS * 6 * 64
    assert summary["parameters"] == json.loads((accumulating / "summary.json").read_text())["parameters"]
    pipeline = summary["pipeline"]
    assert (pipeline["stages"], pipeline["micro_batches"], pipeline["schedule"]) == (2, 3, "gpipe")
    # each stage's bytes, and GPipe's 3 micro-batches of activations alive at once, as the plan says
    rows = summary["predicted_vs_measured"]
    for stage in (0, 1):
        for key in ("parameters", "gradients", "optimizer_states", "activations_in_flight"):
            row = rows[f"stage {stage} {key}_bytes"]
            assert row["measured"] == pytest.approx(row["predicted"], rel=1e-3), (stage, key, row)
    assert pipeline["bubble_formula"] == pytest.approx(1 / 4)
    assert 0 < pipeline["bubble_measured"] < 1 and len(pipeline["idle_fraction_per_stage"]) == 2
    assert "bubble measured" in result.stdout
    png = (run_dir / "pipeline.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    trace = json.loads((run_dir / "pipeline_trace.json").read_text())
    names = {event["name"] for event in trace["traceEvents"] if event.get("ph") == "X"}
    assert {"F0", "F2", "B0", "B2"} <= names


def test_a_pipeline_checkpoint_resumes_in_one_process_and_back(tmp_path, settings, accumulating):
    saved = tmp_path / "saved"
    run(torchrun(2, "--model", "tiny", *settings(2, max_steps=3), *PIPELINE, "train.schedule=1f1b",
                 "--out", str(saved)), tmp_path)
    one = tmp_path / "one"
    shutil.copytree(saved, one)
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--resume", str(one), f"train.max_steps={STEPS}",
         "parallel.pp=1", "train.micro_batches=1", "train.grad_accum=3"], tmp_path)
    assert_close_runs(one, accumulating, atol=1e-5)
    # and a one-process checkpoint continues on a pipeline
    back = tmp_path / "back"
    shutil.copytree(accumulating, back)
    shutil.rmtree(back / "checkpoints" / f"step_{STEPS:07d}")
    (back / "summary.json").unlink()
    run(torchrun(2, "--resume", str(back), *PIPELINE, "train.grad_accum=1"), tmp_path)
    assert_close_runs(back, accumulating, atol=1e-5)


def test_a_killed_stage_stops_the_other_with_one_line(tmp_path, settings):
    run_dir = tmp_path / "run"
    errors = kill_rank_after_first_checkpoint(
        torchrun(2, "--model", "tiny", *settings(2, max_steps=100_000, checkpoint_interval=2), *PIPELINE,
                 "train.dist_timeout=30", "--out", str(run_dir)), run_dir, tmp_path)
    assert len(errors) == 1, errors
    assert errors[0].startswith("lmforge: error: rank 1 stopped answering (died or hangs); rank 0 stops too")
