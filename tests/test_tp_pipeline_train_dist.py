"""`lmforge train` on a pipeline of tensor-parallel stages (parallel.pp=2 x parallel.tp=2,
4 ranks under torchrun, gloo, real prepared data) trains as one process accumulating the same 2
micro-batches, and its checkpoint (whole tensors by name) resumes in one process.

Tolerance: tests/test_tp_train_dist.py's (fp32; the tp sums and the pipeline's tied and norm sums
in another order than one process: losses within 1e-5, per tensor max |diff| <= 2 K lr and at most
0.1% of the elements beyond 1e-5). A stage receiving the wrong tensor rank's activations, a missing
tp sum or a wrong loss average moves most elements by ~lr and the losses in the second decimal.
"""

import json
import sys

import pytest

from tests.test_tp_train_dist import assert_close_runs, losses, run, settings, torchrun  # noqa: F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PP_TP = ["parallel.pp=2", "train.micro_batches=2", "parallel.tp=2"]


def test_lmforge_train_pp2_x_tp2_trains_as_one_process_and_resumes_in_one_process(tmp_path, settings):
    reference = tmp_path / "one"
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(2),
         "train.grad_accum=2", "--out", str(reference)], tmp_path)
    result = run(torchrun(4, "--model", "tiny", *settings(2), *PP_TP, "--out", "run"), tmp_path)
    assert result.stdout.count("lmforge train: summary") == 1  # rank 0 alone reports
    run_dir = tmp_path / "run"
    assert_close_runs(run_dir, reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parameters"] == json.loads((reference / "summary.json").read_text())["parameters"]
    assert summary["pipeline"]["stages"] == 2
    # one rank per stage measured (tensor rank 0), not both tensor ranks of stage 0: stage 1's
    # saved bytes are its own (the plan's), and the timeline has one row per stage
    assert len(summary["pipeline"]["measured_by_stage"]) == len(summary["pipeline"]["idle_fraction_per_stage"]) == 2
    # the end-of-run table: each stage's bytes and rank 0's tensor-parallel traffic as planned, exactly
    rows = summary["predicted_vs_measured"]
    for row in [f"stage {s} {k}_bytes" for s in (0, 1) for k in ("parameters", "gradients", "optimizer_states",
                                                                    "activations")] + ["tp_sent_bytes_per_step"]:
        assert rows[row]["predicted"] == rows[row]["measured"], row
    # both resumed to step 6 in one process: the checkpoint holds the whole model by name
    for folder in (run_dir, reference):
        run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--resume", str(folder), "train.max_steps=6",
             "parallel.tp=1", "parallel.pp=1", "train.micro_batches=1", "train.grad_accum=2"], tmp_path)
    assert [s for s, _ in losses(run_dir)][-3:] == [5, 6, 6]
    assert_close_runs(run_dir, reference, steps=6)
