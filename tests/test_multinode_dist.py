"""A multi-node launch on one machine (issue 26, part 6): two torchrun agents, one process each,
meet through a c10d rendezvous as two machines would, train the tiny preset with ddp and
checkpoint; SIGTERM to both agents stops the run after the same step with a checkpoint, and the
resumed run ends on the very weights and losses of an uninterrupted one (bit for bit: the same
world size, as tests/test_distributed_train.py checks for one node)."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from lmforge.runs.checkpoint.find import list_checkpoints
from test_distributed_train import assert_close_runs, env, free_port, settings  # noqa: F401
from test_faults_dist import RESUME

pytestmark = pytest.mark.dist

TIMEOUT = 180  # seconds a launch may take before the test fails (it never hangs the suite)


def node_commands(*args: str) -> list[list[str]]:
    """The command of each of the two "machines": a torchrun agent with one process."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={run_id}",
             "-m", "lmforge", "train", "--no-progress", *args] for node in (0, 1)]


def launch(*args: str, stop_after_checkpoint=None) -> str:
    """Both nodes' stderr once both ended; with `stop_after_checkpoint` (a run folder) SIGTERM goes
    to both agents once it holds a checkpoint. Every agent is killed at the deadline."""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                              start_new_session=True) for command in node_commands(*args)]
    try:
        if stop_after_checkpoint is not None:
            deadline = time.monotonic() + TIMEOUT
            while not list_checkpoints(stop_after_checkpoint):
                assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint"
                time.sleep(0.2)
            for p in procs:
                os.kill(p.pid, signal.SIGTERM)
        errs = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    if stop_after_checkpoint is None:
        assert all(p.returncode == 0 for p in procs), "\n".join(err[-2000:] for err in errs)
    return "\n".join(errs)


def test_two_nodes_stopped_by_sigterm_resume_to_the_uninterrupted_run(tmp_path, settings):
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    stderr = launch("--model", "tiny", *settings(3, max_steps=100_000, checkpoint_interval=2), "train.parallel=ddp",
                    "--out", str(run_dir), stop_after_checkpoint=run_dir)
    match = RESUME.search(stderr)
    assert match and match.group(1) == "SIGTERM", stderr[-3000:]
    step, resume = int(match.group(2)), match.group(3)
    assert list_checkpoints(run_dir)[-1].name == f"step_{step:07d}"
    assert resume.startswith("torchrun --nnodes=2 --node_rank=") and resume.endswith(
        f"-m lmforge train --resume {run_dir} (on each of the 2 nodes, with its own torchrun options)"), resume
    launch("--resume", str(run_dir), f"train.max_steps={step + 2}")
    launch("--model", "tiny", *settings(3, max_steps=step + 2, checkpoint_interval=2), "train.parallel=ddp",
           "--out", str(reference))
    assert_close_runs(run_dir, reference, atol=0)
