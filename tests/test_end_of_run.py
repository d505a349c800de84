"""The end of a run (issue 44): a stop request after the last step, and the sample as the terminal shows it.

The subprocess test runs the real CLI on the tiny preset; every wait has a deadline (tests/test_reliability.py's
helpers) and no assertion depends on timing.
"""

import json
import os
import signal
from pathlib import Path

from lmforge.runs.checkpoint.find import find_checkpoint, verify_checkpoint
from tests.conftest import tiny_overrides
from tests.test_reliability import STOPPED, finish, logged_steps, one_line, start, wait_until


def val_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and "val_loss" in line]


def stop_when(run_dir: Path, args: list[str], ready, what: str) -> tuple[int, str]:
    """Start `lmforge train ARGS`, send SIGTERM once `ready()`; (the saved step, stderr)."""
    proc = start("train", *args, "--no-progress")
    wait_until(proc, ready, what)
    os.kill(proc.pid, signal.SIGTERM)
    status, _, err = finish(proc)
    assert status == 143, err  # before issue 44's fix: 0, the evaluation and the sample run to their end
    name, step, saved, _ = STOPPED.match(one_line(err)).groups()
    assert name == "SIGTERM" and Path(saved) == find_checkpoint(run_dir)
    verify_checkpoint(Path(saved))
    assert not (run_dir / "summary.json").exists()
    return int(step), err


def test_a_sigterm_during_the_final_evaluation_or_the_sample_stops_saves_and_the_resume_finishes(
        tmp_path, corpus_dir, data_dir):
    run = tmp_path / "run"
    # the final evaluation alone, of more batches than the test could wait for
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=4, eval_interval=0, eval_batches=10**6)
    step, _ = stop_when(run, ["--model", "tiny", "--out", str(run), *overrides],
                        lambda: 4 in logged_steps(run), "the last step's record")
    assert step == 4 and val_steps(run) == []

    # resumed at the last step, the run evaluates (it was stopped before its validation loss), then
    # samples far more tokens than the test could wait for
    step, _ = stop_when(run, ["--resume", str(run), "train.eval_batches=2", "train.sample_tokens=10000000"],
                        lambda: val_steps(run) == [4], "the final evaluation")
    assert step == 4

    proc = start("train", "--resume", str(run), "--no-progress", "train.eval_batches=2", "train.sample_tokens=4")
    status, out, err = finish(proc)
    assert status == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["val_loss"] > 0 and "sample" in summary


def test_an_evaluation_a_sigterm_cut_short_during_training_is_done_on_resuming(tmp_path, corpus_dir, data_dir):
    """Stopped inside step 2's evaluation (more batches than the test could wait for), the run saves
    step 2 without its validation loss; the resume evaluates step 2 first, so its records are an
    uninterrupted run's: step 2's val record before step 3's (before the fix it was never written)."""
    run = tmp_path / "run"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=4, eval_interval=2, checkpoint_interval=4,
                               log_interval=1, eval_batches=10**6)
    step, _ = stop_when(run, ["--model", "tiny", "--out", str(run), *overrides],
                        lambda: 2 in logged_steps(run), "step 2's record")
    assert step == 2 and val_steps(run) == []

    proc = start("train", "--resume", str(run), "--no-progress", "train.eval_batches=2")
    status, _, err = finish(proc)
    assert status == 0, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "val_loss" in r) for r in records if "train_loss" in r or "val_loss" in r] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True)]


def test_the_sample_on_the_terminal_has_its_control_characters_escaped():
    from lmforge.common.errors import for_terminal

    # ESC [2J clears the screen, NUL and BEL are invisible or ring: shown as escapes; newline and tab kept
    assert for_terminal("a\x1b[2Jb\x00c\x07\nd\te") == "a\\x1b[2Jb\\x00c\\x07\nd\te"
    assert for_terminal("plain text, é and 中") == "plain text, é and 中"
