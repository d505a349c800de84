"""Faults under torchrun, each with a real signal to a real rank or launcher (issue 26, part 5).

- rank 0 killed (SIGKILL) or hung (SIGSTOP): the surviving rank prints the one lmforge line;
- a rank stuck in a collective when SIGTERM comes (torchrun's agent stopping the survivors) still
  says who is missing (train/signals.py's watch);
- torchrun's agent killed (SIGKILL): its ranks see their parent gone, save and stop, and release
  the run folder's lock (parallel/faults.py, watch_launcher);
- SIGTERM to torchrun: the line printed says the torchrun command that resumes, and it does; it
  comes after torchrun's own traceback, during setup too (common/last_word.py);
- `lmforge train --nproc 2`: exit statuses as one process (143 SIGTERM, 130 Ctrl-C, 2 refused),
  no traceback, and its resume command is `lmforge train --nproc 2 --resume RUN`.
(A worker killed in a two-node launch: tests/test_multinode_dist.py.)

Every launch has a deadline and every started process is killed at the end, whatever happened.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.common.folders import is_locked
from lmforge.runs.checkpoint.find import list_checkpoints
from test_distributed_train import env, kill_rank_after_first_checkpoint, rank_pid, settings, torchrun  # noqa: F401

pytestmark = pytest.mark.dist

TIMEOUT = 180  # seconds any launch (or wait) may take before the test fails
RESUME = re.compile(r"lmforge: stopped by (SIGTERM|SIGINT) at step (\d+); saved \S+; continue with: (.+)$", re.M)


def endless(settings, run_dir, *extra) -> list[str]:
    """A 2-rank ddp run that would train for ever, a checkpoint every 2 steps."""
    return ["--model", "tiny", *settings(3, max_steps=100_000, checkpoint_interval=2), "train.parallel=ddp",
            *extra, "--out", str(run_dir)]


def gone(pid: int) -> bool:
    """Whether `pid` exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def start(command, cwd) -> subprocess.Popen:
    # its own session: a signal to its process group reaches the launcher and its ranks, as Ctrl-C does
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)


def wait_for_checkpoint(proc, run_dir) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not list_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint before the deadline"
        time.sleep(0.2)


def finish(proc, pids=()) -> str:
    """The launch's stderr once it ended; it and `pids` are killed if still there at the deadline."""
    try:
        return proc.communicate(timeout=TIMEOUT)[1]
    finally:
        for pid in (proc.pid, *pids):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate()


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lmforge: error:")]


def said(stderr_file: Path) -> str:
    """The stderr a launch wrote to `stderr_file`, once its lmforge line is there: under torchrun
    that line comes a moment after the agent exits (common/last_word.py)."""
    deadline = time.monotonic() + TIMEOUT
    while not errors(stderr_file.read_text()):
        assert time.monotonic() < deadline, stderr_file.read_text()[-3000:]
        time.sleep(0.1)
    return stderr_file.read_text()


def resume_line(stderr: str) -> tuple[int, list[str]]:
    """(the step the run stopped at, the command it says continues it)."""
    match = RESUME.search(stderr)
    assert match, stderr[-3000:]
    return int(match.group(2)), shlex.split(match.group(3))


def test_a_killed_rank_0_is_reported_by_the_rank_that_survives(tmp_path, settings):
    run_dir = tmp_path / "run"
    lines = kill_rank_after_first_checkpoint(torchrun(2, *endless(settings, run_dir, "train.dist_timeout=30")),
                                             run_dir, tmp_path, rank=0)
    assert len(lines) == 1, lines
    assert lines[0].startswith("lmforge: error: rank 0 stopped answering (died or hangs); rank 1 stops too")


def test_a_hung_rank_0_is_reported_by_the_rank_that_survives(tmp_path, settings):
    """SIGSTOP freezes rank 0: rank 1 finds out at the collective timeout (5 s), then by the roll call."""
    run_dir = tmp_path / "run"
    proc = start(torchrun(2, *endless(settings, run_dir, "train.dist_timeout=5")), tmp_path)
    pids = []
    try:
        wait_for_checkpoint(proc, run_dir)
        pids = [rank_pid(proc.pid, rank) for rank in (0, 1)]
        os.kill(pids[0], signal.SIGSTOP)
        deadline = time.monotonic() + TIMEOUT
        while not gone(pids[1]):  # then torchrun would wait 30 s for the frozen rank 0: kill it
            assert time.monotonic() < deadline, "rank 1 did not stop"
            time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
    finally:
        stderr = finish(proc, pids)
    lines = errors(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("lmforge: error: rank 0 stopped answering (died or hangs); rank 1 stops too")


def test_ranks_of_a_killed_launcher_save_stop_and_release_the_lock(tmp_path, settings):
    run_dir = tmp_path / "run"
    proc = start(torchrun(2, *endless(settings, run_dir)), tmp_path)
    pids = []
    try:
        wait_for_checkpoint(proc, run_dir)
        pids = [rank_pid(proc.pid, rank) for rank in (0, 1)]
        assert None not in pids and is_locked(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120  # a few steps and a checkpoint; before the fix: 100,000 steps
        while not all(gone(pid) for pid in pids):
            assert time.monotonic() < deadline, "the ranks of a killed launcher are still training"
            time.sleep(0.2)
    finally:
        stderr = finish(proc, pids)
    assert not is_locked(run_dir)
    assert "rank 0: the launcher (process" in stderr and "Traceback" not in stderr, stderr[-3000:]
    step, _ = resume_line(stderr)
    assert list_checkpoints(run_dir)[-1].name == f"step_{step:07d}"


def test_sigterm_to_torchrun_prints_the_torchrun_command_that_resumes(tmp_path, settings):
    run_dir = tmp_path / "run"
    command = torchrun(2, *endless(settings, run_dir))
    proc = start(command, tmp_path)
    try:
        wait_for_checkpoint(proc, run_dir)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        stderr = finish(proc)
    step, resume = resume_line(stderr)
    # after torchrun's own SignalException traceback (common/last_word.py)
    assert "SignalException" in stderr and RESUME.fullmatch(stderr.rstrip("\n").splitlines()[-1]), stderr[-3000:]
    launcher = command[:command.index("-m", 3)][3:]  # torchrun's own options, as typed
    assert resume == ["torchrun", *launcher, "-m", "lmforge", "train", "--resume", str(run_dir)], resume
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *resume[1:], f"train.max_steps={step + 1}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert list_checkpoints(run_dir)[-1].name == f"step_{step + 1:07d}"


def lmforge_nproc(*args) -> list[str]:
    return [sys.executable, "-m", "lmforge", "train", "--nproc", "2", "--no-progress", *args]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_nproc_launcher_stops_as_one_process_does(tmp_path, settings, signum):
    """SIGTERM to the launcher (a scheduler) or SIGINT to its process group (Ctrl-C in a terminal):
    128 + the signal, no traceback, and the resume command of `--nproc`, which works."""
    run_dir = tmp_path / "run"
    proc = start(lmforge_nproc(*endless(settings, run_dir)), tmp_path)
    try:
        wait_for_checkpoint(proc, run_dir)
        if signum == signal.SIGTERM:
            os.kill(proc.pid, signum)
        else:
            os.killpg(proc.pid, signum)
    finally:
        stderr = finish(proc)
    assert proc.returncode == 128 + signum and "Traceback" not in stderr, (proc.returncode, stderr[-3000:])
    assert RESUME.fullmatch(stderr.rstrip("\n").splitlines()[-1]), stderr[-3000:]  # after torch's agent's log
    step, resume = resume_line(stderr)
    assert resume == ["lmforge", "train", "--nproc", "2", "--resume", str(run_dir)]
    if signum == signal.SIGTERM:  # the command works (once is enough)
        result = subprocess.run([sys.executable, "-m", "lmforge", *resume[1:], "--no-progress",
                                 f"train.max_steps={step + 1}"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env())
        assert result.returncode == 0, result.stderr[-3000:]


def test_the_nproc_launcher_refuses_as_one_process_does(tmp_path, settings):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")  # an existing run: a new run into it is refused by rank 0
    result = subprocess.run(lmforge_nproc("--model", "tiny", *settings(3), "train.parallel=ddp", "--out", str(run_dir)),
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors(result.stderr)) == 1 and "already exists" in result.stderr, result.stderr[-3000:]
    # lmforge's line last, after the "failed (exitcode: 2)" that torch's agent logs inside the launcher
    assert "exitcode: 2" in result.stderr, result.stderr[-3000:]
    assert result.stderr.rstrip("\n").splitlines()[-1] == errors(result.stderr)[0], result.stderr[-3000:]


def test_a_rank_stuck_in_a_collective_when_sigterm_comes_says_who_is_missing(tmp_path):
    """tests/stuck_worker.py: rank 0 waits in dist.recv for a rank that never sends; a real SIGTERM
    reaches rank 0 there (its Python handler cannot run), and the watch takes the roll call."""
    worker = Path(__file__).parent / "stuck_worker.py"
    proc = start([*torchrun(2)[:5], str(worker)], tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "waiting").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 0 never started waiting"
            time.sleep(0.2)
        time.sleep(1.0)  # inside dist.recv by now
        os.kill(rank_pid(proc.pid, 0), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # the group's own timeout is 300 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [line for line in stderr.splitlines() if line.startswith("lmforge: error:")]
    assert errors == ["lmforge: error: rank 1 stopped answering (died or hangs); rank 0 stops too (stopped by "
                      "torchrun's agent while waiting in a collective); continue from the last checkpoint with "
                      "the same launch command and --resume"], stderr[-3000:]


def test_a_slow_step_when_every_rank_gets_sigterm_is_a_plain_stop(tmp_path):
    """tests/stuck_worker.py slow: a scheduler's SIGTERM reaches both ranks while rank 0 waits in
    dist.recv past STUCK_SECONDS for rank 1's slow step. Rank 0's watch takes the roll call; rank 1
    answers it (its watch says it is alive on the SIGTERM), so nobody is reported and both ranks
    record the stop. Without rank 1's answer, rank 0 says "rank 1 stopped answering" and exits 2."""
    worker = Path(__file__).parent / "stuck_worker.py"
    proc = start([*torchrun(2)[:5], str(worker), "slow"], tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / f"waiting{rank}").exists() for rank in (0, 1)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        time.sleep(0.5)  # rank 0 inside dist.recv by now
        for rank in (0, 1):
            os.kill(rank_pid(proc.pid, rank), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "lmforge: error:" not in stderr and proc.returncode == 0, stderr[-3000:]
    recorded = [(tmp_path / f"stopped{rank}").read_text() for rank in (0, 1)]
    assert recorded == [str(int(signal.SIGTERM))] * 2, recorded



@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """About 20 MB of Python: rank 0 prepares it for seconds, while rank 1 waits (and says so)."""
    from tests.conftest import stdlib_corpus

    return stdlib_corpus(tmp_path_factory.mktemp("big_corpus"), 20_000_000, recursive=True)


def start_in_setup(tmp_path, big_corpus) -> tuple[subprocess.Popen, Path, float]:
    """A 2-rank tiny ddp run under torchrun, stderr to a file, once rank 1 waits for rank 0 to
    prepare the data (the setup the tests below interrupt): (torchrun, the file, the deadline)."""
    from tests.conftest import tiny_overrides

    overrides = tiny_overrides(big_corpus, tmp_path / "data", max_steps=2, batch_size=2)
    stderr_file = tmp_path / "stderr"
    with open(stderr_file, "w") as stderr:
        proc = subprocess.Popen(torchrun(2, "--model", "tiny", *overrides, "train.parallel=ddp", "--out", "run"),
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, env=env(),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while "rank 1: waiting for rank 0 to prepare" not in stderr_file.read_text():
            assert proc.poll() is None, stderr_file.read_text()[-3000:]
            assert time.monotonic() < deadline, "rank 1 never waited for rank 0"
            time.sleep(0.1)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, stderr_file, deadline


def test_rank_0_killed_during_setup_is_reported_by_the_rank_that_survives(tmp_path, big_corpus):
    """Rank 0 dies while it prepares the data (rank 1 waits for it through the store, outside any
    collective): torchrun's agent SIGTERMs rank 1, which takes the roll call and says who is gone.
    Before the fix rank 1 died on that SIGTERM without a word."""
    proc, stderr_file, _ = start_in_setup(tmp_path, big_corpus)
    pids = []
    try:
        pids = [rank_pid(proc.pid, rank) for rank in (0, 1)]
        os.kill(pids[0], signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = said(stderr_file)
    assert errors(stderr) == ["lmforge: error: rank 0 stopped answering (died or hangs); rank 1 stops too (stopped by "
                              "torchrun's agent during setup, before the first step); continue from the last checkpoint "
                              "with the same launch command and --resume"], stderr[-3000:]


def test_sigterm_to_torchrun_during_setup_ends_on_lmforge_s_line(tmp_path, big_corpus):
    """torchrun stopped (SIGTERM) while rank 0 prepares the data: every rank answers the roll call,
    so it is a plain stop; rank 0's line comes after torchrun's own SignalException traceback."""
    proc, stderr_file, deadline = start_in_setup(tmp_path, big_corpus)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=TIMEOUT)
        line = "lmforge: stopped by SIGTERM during setup, before the first step: nothing to save"
        while line not in stderr_file.read_text():  # a moment after the agent exits (common/last_word.py)
            assert time.monotonic() < deadline, stderr_file.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = stderr_file.read_text()
    assert "SignalException" in stderr and stderr.rstrip("\n").splitlines()[-1] == line, stderr[-3000:]
    assert stderr.count(line) == 1 and "lmforge: error" not in stderr, stderr[-3000:]
