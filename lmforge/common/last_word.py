"""The line a run ends on (an error's, or the command that continues a stopped run), said last
under torchrun, after the output of torchrun's own agent.

Under torchrun, the rank that says why the run failed exits, and then its agent (the torchrun
process that started it, on that node) writes its own account of that exit to the same stderr:
a ChildFailedError traceback ("lmforge FAILED ... exitcode: 2"; a SignalException traceback when
the agent itself was stopped by SIGTERM or Ctrl-C), and in a multi-node c10d launch whose
rendezvous store was held by a node that is gone, TCPStore warnings with C++ stack traces and a
RendezvousConnectionError traceback. That output comes from the agent after the rank
is gone: nothing in the rank can keep it quiet. So the rank hands its line to a small process of
its own (this module, run with `python -m`), which waits for the agent to exit and then writes the
line in one write: the last thing on that stderr, whole. A log file or a pipe ends with it; in a
terminal the shell's prompt may come just before it.

Under `lmforge train --nproc N` the agent runs inside lmforge's own launcher, which logs each
rank's exit ("failed (exitcode: 2) local_rank: 1 ...") after the rank's line: there the rank appends
its line to a file the launcher names (HANDED_TO_LAUNCHER) and the launcher says it once its agent is
done (`said_by_launcher`). Printed at once instead (as without torchrun): one process, under an agent
that will start the ranks again (--max-restarts left), and where no process can be started.
"""

import contextlib
import os
import select
import subprocess
import sys
import time

# How long the helper waits for the agent: torchrun gives the other ranks 30 s between its SIGTERM and
# its SIGKILL, then tears down its rendezvous (seconds). Past it the line is said anyway: never lost.
AGENT_WAIT_SECONDS = 60
POLL_SECONDS = 0.05  # where the kernel has no pidfd (Linux before 5.3): how often the helper looks
HANDED_TO_LAUNCHER = "LMFORGE_LAST_WORD_FILE"  # set by `lmforge train --nproc`'s launcher for its ranks


def say_error(message: str) -> None:
    """`lmforge: error: MESSAGE`, the line every command stops on, said last (see the docstring)."""
    say_last(f"lmforge: error: {message}")


def say_last(line: str) -> None:
    """Print `line` on stderr: at once, or under torchrun's agent after the agent's own output."""
    handed = os.environ.get(HANDED_TO_LAUNCHER)
    if handed:
        try:  # one short append: whole even when ranks write at the same time
            with open(handed, "a", encoding="utf-8") as lines:
                lines.write(line + "\n")
            return
        except OSError:  # the launcher's file is gone: say it now
            pass
    agent = torchrun_agent()
    if agent is not None:
        try:
            # its own session: torchrun's SIGTERM to this rank's process group and a terminal's Ctrl-C
            # do not reach it; only stderr is inherited (not the run folder's lock)
            subprocess.Popen([sys.executable, "-m", __name__, str(agent), line], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, start_new_session=True, env=_finding_lmforge())
            return
        except OSError:  # no process can be started (memory, process limit): say it now
            pass
    print(line, file=sys.stderr, flush=True)


def _finding_lmforge() -> dict:
    """This process's environment, with the folder that holds this lmforge first on the import path:
    the helper finds the same lmforge whatever the folder it starts in."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def torchrun_agent() -> int | None:
    """The pid of the torchrun agent that started this process, if it ends when this process
    fails (no restart left); None otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts_left > 0:
            return None  # the agent starts the ranks again: this is not the end of its output
        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except (OSError, ValueError):  # no /proc (not Linux): the line at once
        return None
    # torchrun itself (`torchrun`, `python -m torch.distributed.run`); `lmforge train --nproc` hands its
    # ranks' lines to its launcher instead (said_by_launcher)
    launched = any(word in (b"torch.distributed.run", b"torch.distributed.launch")
                   or os.path.basename(word) == b"torchrun" for word in words)
    return parent if launched else None


def wait_then_say(agent: int, line: str, limit: float = AGENT_WAIT_SECONDS) -> None:
    """Wait until process `agent` has exited (at most `limit` seconds), then write `line` to stderr."""
    try:
        pidfd = os.pidfd_open(agent)
    except ProcessLookupError:  # gone already
        pidfd = None
    except OSError:  # no pidfd in this kernel: look every POLL_SECONDS
        deadline = time.monotonic() + limit
        while _running(agent) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [], limit)  # readable once the process has exited
        os.close(pidfd)
    with contextlib.suppress(OSError):  # nobody reads stderr any more: nothing to tell
        os.write(sys.stderr.fileno(), (line + "\n").encode())


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie nobody reaped yet has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def said_by_launcher():
    """For `lmforge train --nproc`: the ranks started inside hand their last lines to a file, said
    here (each once, in order) when the block ends, after everything torch's agent wrote."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="lmforge-last-word-")
    os.close(fd)
    os.environ[HANDED_TO_LAUNCHER] = path
    try:
        yield
    finally:
        os.environ.pop(HANDED_TO_LAUNCHER, None)
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                said = list(dict.fromkeys(line.rstrip("\n") for line in f if line.strip()))
            os.unlink(path)
            if said:
                sys.stderr.flush()
                print(*said, sep="\n", file=sys.stderr, flush=True)


if __name__ == "__main__":
    wait_then_say(int(sys.argv[1]), sys.argv[2])
