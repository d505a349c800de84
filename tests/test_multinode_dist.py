"""A multi-node launch on one machine (issue 26, part 6): two torchrun agents, one process each,
meet through a c10d rendezvous as two machines would, train the tiny preset with ddp and
checkpoint; SIGTERM to both agents stops the run after the same step with a checkpoint, and the
resumed run ends on the very weights and losses of an uninterrupted one (bit for bit: the same
world size, as tests/test_distributed_train.py checks for one node). A worker killed (SIGKILL) on
one node: the surviving node's stderr ends with lmforge's whole line, after torchrun's own
traceback (lmforge/common/last_word.py)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from lmforge.runs.checkpoint.find import list_checkpoints
from test_distributed_train import assert_close_runs, env, free_port, rank_pid, settings  # noqa: F401
from test_faults_dist import RESUME, endless, errors, finish, start, wait_for_checkpoint

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


DIST_TIMEOUT = 30  # the killed launch's train.dist_timeout: the survivor's line must end it within this + 10 s
LAST_LINE = re.compile(r"lmforge: error: rank \d stopped answering \(died or hangs\); rank \d stops too \(.+\); "
                       r"continue from the last checkpoint with the same launch command and --resume")


def test_a_worker_killed_on_one_node_leaves_lmforge_s_line_last_on_the_other(tmp_path, settings):
    """Node A's agent starts first, so it holds the rendezvous store; its worker is SIGKILLed. Node
    A's agent exits (ChildFailedError), taking the store with it: node B's agent loses it and ends
    in TCPStore warnings and a RendezvousConnectionError traceback, after its worker said who is
    gone. lmforge's line must still be the last of node B's stderr, whole, once, within the
    collective timeout plus 10 s of the kill. Before the fix it came before that traceback, its
    cause cut mid-word at 200 characters."""
    run_dir = tmp_path / "run"
    node_a_command, node_b_command = node_commands(*endless(settings, run_dir, f"train.dist_timeout={DIST_TIMEOUT}"))
    port = int(next(word for word in node_a_command if word.startswith("--rdzv_endpoint=")).rsplit(":", 1)[1])
    with open(tmp_path / "node_a.err", "w") as node_a_err:  # a file: nobody need read it while it runs
        node_a = subprocess.Popen(node_a_command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=node_a_err,
                                  env=env(), start_new_session=True)
    node_b = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while not listening(port):  # node A holds the store before node B starts
            assert node_a.poll() is None and time.monotonic() < deadline, (tmp_path / "node_a.err").read_text()
            time.sleep(0.1)
        node_b = start(node_b_command, tmp_path)
        wait_for_checkpoint(node_b, run_dir)
        worker = next(pid for rank in (0, 1) if (pid := rank_pid(node_a.pid, rank)) is not None)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        stderr = finish(node_b)  # to its end: the agent, its worker and the helper that says the line last
        elapsed = time.monotonic() - killed
    finally:
        for node in (node_a, node_b):
            if node is not None and node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert "RendezvousConnectionError" in stderr, stderr[-3000:]  # torch's own traceback: the case at hand
    last = stderr.rstrip("\n").splitlines()[-1]
    assert LAST_LINE.fullmatch(last) and errors(stderr) == [last], stderr[-3000:]
    assert elapsed < DIST_TIMEOUT + 10, elapsed


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
