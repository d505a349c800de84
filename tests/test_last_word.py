"""An error's line said last under torchrun (lmforge/common/last_word.py), with real processes:
a stand-in agent that writes its own output on exit, and the helper that outlives it; a gloo
error's cause, as the failure line gives it (parallel/faults.py's cause)."""

import os
import subprocess
import sys
from pathlib import Path

from lmforge.common import last_word
from lmforge.parallel.faults import cause

ROOT = Path(__file__).resolve().parents[1]
# what torchrun's agent does once its rank has said its line: a moment later, its own traceback, then exit
AGENT = "import sys, time; time.sleep(float(sys.argv[1])); print('Traceback (most recent call last): ...', " \
        "file=sys.stderr, flush=True)"


def test_the_helper_says_the_line_after_the_agent_has_exited():
    read, write = os.pipe()  # the stderr the agent and the helper share, as a rank's helper shares its agent's
    agent = subprocess.Popen([sys.executable, "-c", AGENT, "1.5"], stderr=write)
    line = "lmforge: error: rank 1 stopped answering (died or hangs); rank 0 stops too (x); continue ..."
    helper = subprocess.Popen([sys.executable, "-m", "lmforge.common.last_word", str(agent.pid), line],
                              stderr=write, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(write)
    try:
        with os.fdopen(read) as pipe:
            stderr = pipe.read()  # to the end: both have exited
    finally:
        for process in (agent, helper):
            if process.poll() is None:
                process.kill()
            process.wait()
    assert stderr.splitlines() == ["Traceback (most recent call last): ...", line], stderr


def test_the_helper_says_the_line_at_once_when_the_agent_is_gone(capfd):
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    agent.wait()
    last_word.wait_then_say(agent.pid, "lmforge: error: x", limit=60)  # a limit it must not wait for
    assert capfd.readouterr().err == "lmforge: error: x\n"


def test_only_an_agent_that_ends_with_the_rank_is_waited_for(monkeypatch, capsys):
    """Outside torchrun, and where the agent starts the ranks again, the line is printed at once;
    the parent of this test process is no torchrun agent either."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert last_word.torchrun_agent() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert last_word.torchrun_agent() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert last_word.torchrun_agent() is None  # the last attempt, but pytest is not torchrun
    last_word.say_error("at once")
    assert capsys.readouterr().err == "lmforge: error: at once\n"


def test_a_gloo_error_s_cause_is_short_and_never_cut_inside_a_word():
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26288: "
            "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
            "application, check the logs of the other ranks")
    assert cause(RuntimeError(gloo)) == "Read error [127.0.0.1]:26288: Connection reset by peer"
    long = RuntimeError(" ".join(["connection"] * 40))
    words = cause(long).removesuffix("...").split(" ")
    assert cause(long).endswith("...") and set(words) == {"connection"}, cause(long)
    assert cause(RuntimeError("")) == "RuntimeError"
