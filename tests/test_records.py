"""Records that agree with the disk (issue 44, class 6), one process:

- `lmforge runs` on a run killed with kill -9 shows the step its newest checkpoint holds (where a
  resume starts), not the last one it logged, and says it crashed;
- `tokens_trained` of a run resumed with another global batch is the sum of each session's tokens,
  not its steps times the last batch (summary.json and the metrics' tokens_seen).

The torchrun cases (the logging window, a tied matrix under tp, FSDP2's traffic): test_records_dist.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

from lmforge.cli import main
from lmforge.runs.checkpoint.find import list_checkpoints
from lmforge.runs.listing import read_config
from lmforge.runs.metrics import read_metrics
from tests.conftest import tiny_overrides

TIMEOUT = 300  # seconds a launch may take before the test fails


def lmforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=TIMEOUT, env={**os.environ, "COLUMNS": "200"})


def logged_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path)), default=0) if path.is_file() else 0


def saved_step(run_dir) -> int:
    found = list_checkpoints(run_dir)
    return int(found[-1].name.removeprefix("step_")) if found else 0


def kill_after_unsaved_steps(command, run_dir, cwd) -> None:
    """Run `command` until it has logged steps past its newest checkpoint, then kill -9 it. Each look
    at the disk is taken with the process frozen (SIGSTOP), so what is seen is what the kill leaves."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no unsaved step logged before the deadline"
            time.sleep(0.1)
            os.kill(proc.pid, signal.SIGSTOP)
            if saved_step(run_dir) > 0 and logged_step(run_dir) > saved_step(run_dir):
                os.kill(proc.pid, signal.SIGKILL)
                break
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_runs_shows_the_saved_step_of_a_run_killed_after_it_and_that_it_crashed(tmp_path, corpus_dir, data_dir):
    run_dir = tmp_path / "runs" / "killed"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=100_000, checkpoint_interval=4, log_interval=1,
                               eval_interval=0)
    kill_after_unsaved_steps([sys.executable, "-m", "lmforge", "train", "--model", "tiny", "--no-progress",
                              *overrides, "--out", str(run_dir)], run_dir, tmp_path)
    saved, logged = saved_step(run_dir), logged_step(run_dir)
    assert 0 < saved < logged
    result = lmforge("runs", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("killed"))
    assert f" {saved:,} / 100,000 (logged {logged:,}, lost) " in row and row.split()[-1] == "crashed", row


def test_tokens_trained_add_each_sessions_global_batch(tmp_path, corpus_dir, data_dir):
    run_dir = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--out", str(run_dir), "--no-progress",
                 *tiny_overrides(corpus_dir, data_dir, max_steps=4, batch_size=4)]) == 0
    # resumed with half the batch: 4 more steps of 2 sequences
    assert main(["train", "--resume", str(run_dir), "--no-progress", "train.max_steps=8", "train.batch_size=2"]) == 0
    seq_len = read_config(run_dir).seq_len
    expected = 4 * 4 * seq_len + 4 * 2 * seq_len
    assert json.loads((run_dir / "summary.json").read_text())["tokens_trained"] == expected
    seen = {r["step"]: r["tokens_seen"] for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_seen" in r}
    assert seen[2] == 2 * 4 * seq_len and seen[6] == 4 * 4 * seq_len + 2 * 2 * seq_len and seen[8] == expected
