"""Records that agree with the disk under torchrun (issue 44, class 6), each a real 2-rank launch:

- the ranks of a killed torchrun agent save and stop inside a logging window (parallel/faults.py):
  the run resumed logs the same train loss as one never interrupted (the window's loss saved with
  any rank's stop request, not only the signal this rank received itself);
- a tied-embedding model under parallel.tp=2 stores its matrix once, as one process does, and resumes;
- FSDP2 (parallel.dp_shard): the end-of-run table says its collectives' bytes are not measured
  instead of measuring 0 B.

The one-process cases: test_records.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.runs.checkpoint.find import list_checkpoints, read_state
from lmforge.runs.checkpoint.read import load_model_weights
from lmforge.runs.checkpoint.tensors import stored_tensors
from lmforge.runs.metrics import read_metrics
from test_distributed_train import env, rank_pid, settings, torchrun  # noqa: F401
from test_faults_dist import TIMEOUT, finish, gone, resume_line, start

pytestmark = pytest.mark.dist

LONG = 50_000  # a log and checkpoint interval no launch here reaches


def launch(command, cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                            env={**env(), "COLUMNS": "200"})  # the end-of-run table unwrapped
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train_records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r}


def test_a_run_whose_launcher_was_killed_logs_the_same_loss_after_resuming(tmp_path, settings):
    """One logging window over the whole run (validation every 2 steps shows it is training, and
    does not end the window): the ranks stop inside it, and the record at its end covers the steps
    before the stop too."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    window = dict(log_interval=LONG, checkpoint_interval=LONG, eval_interval=2)
    proc = start(torchrun(2, "--model", "tiny", *settings(3, max_steps=100_000, **window), "train.parallel=ddp",
                          "--out", str(run_dir)), tmp_path)
    pids = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "metrics.jsonl").is_file() or not read_metrics(run_dir / "metrics.jsonl"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no validation before the deadline"
            time.sleep(0.2)
        pids = [rank_pid(proc.pid, rank) for rank in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)
        while not all(gone(pid) for pid in pids if pid is not None):
            assert time.monotonic() < deadline, "the ranks of a killed launcher are still training"
            time.sleep(0.2)
    finally:
        stderr = finish(proc, [pid for pid in pids if pid is not None])
    step, _ = resume_line(stderr)
    assert step > 1 and not train_records(run_dir), step  # stopped inside the window (evaluation does not end it)
    last = step + 2
    launch(torchrun(2, "--resume", str(run_dir), f"train.max_steps={last}"), tmp_path)
    launch(torchrun(2, "--model", "tiny", *settings(3, max_steps=last, **window), "train.parallel=ddp",
                    "--out", str(reference)), tmp_path)
    resumed, uninterrupted = train_records(run_dir)[last], train_records(reference)[last]
    for key in ("train_loss", "grad_norm", "lr", "skipped_steps", "tokens_seen"):
        assert resumed[key] == uninterrupted[key], (key, resumed[key], uninterrupted[key])


def test_a_tied_model_under_tensor_parallelism_stores_its_matrix_once(tmp_path, settings):
    run_dir = tmp_path / "run"
    launch(torchrun(2, "--model", "tiny", *settings(2, max_steps=2, checkpoint_interval=2, eval_interval=2),
                    "parallel.tp=2", "--out", str(run_dir)), tmp_path)
    model = Transformer(make_config("tiny").model)
    assert model.lm_head.weight is model.tok_embeddings.weight
    unique = {name for name, _ in model.named_parameters()}  # a tied parameter under its first name
    path = list_checkpoints(run_dir)[-1]
    assert set(stored_tensors(path, "model")) == unique and "lm_head.weight" not in unique
    assert read_state(path)["parameters"] == sum(p.numel() for p in model.parameters())
    load_model_weights(model, path)  # strict: the one process reads it, tied
    launch(torchrun(2, "--resume", str(run_dir), "train.max_steps=3"), tmp_path)  # and tp restores from it
    assert list_checkpoints(run_dir)[-1].name == "step_0000003"


def test_fsdp2_traffic_is_not_measured_rather_than_zero(tmp_path, settings):
    run_dir = tmp_path / "run"
    result = launch(torchrun(2, "--model", "tiny", *settings(2, max_steps=2), "parallel.dp_shard=2",
                             "--out", str(run_dir)), tmp_path)
    row = json.loads((run_dir / "summary.json").read_text())["predicted_vs_measured"]["sent_bytes_per_step"]
    assert row["predicted"] > 0 and row["measured"] is None, row
    line = next(line for line in result.stdout.splitlines() if "sent per step per rank (collectives)" in line)
    assert "not measured" in line, line
