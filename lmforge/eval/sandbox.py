"""Running model-written code: each program in a fresh Python process that cannot hang, flood or
reach out of lmforge.

What holds a program in (`run_program`):
- its own session and process group (start_new_session), in a new temporary directory that is
  removed afterwards; the interpreter runs isolated (-I: no environment variables, no user site);
- resource limits set in the child before exec (resource.setrlimit): CPU seconds, address space
  (memory), processes (RLIMIT_NPROC, which the kernel ignores for root: a root lmforge runs the
  program as user `nobody`, with an interpreter `nobody` may run: `interpreter`), file size;
- no network: where `unshare` can make a user namespace, the program runs in new network and PID
  namespaces (`unshare -rn --pid --fork --kill-child`: no interface but a down loopback, and every
  process it starts dies with it, even one that left the process group); elsewhere a prelude replaces
  socket.socket and socket.create_connection with a function that raises (`NETWORK` says which);
- a wall-clock timeout, after which the whole process group is killed (os.killpg, SIGKILL); it is
  killed after a normal exit too, so that nothing a program forked outlives it.
A program passes when it exits with status 0 within its limits. Anything else is a fail.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", section 2.1): from n samples of which c pass, 1 - C(n-c, k) / C(n, k), computed as the
product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the large binomials.
"""

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PRELUDE = '''import socket as _socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in lmforge's sandbox")
_socket.socket = _socket.create_connection = _socket.socketpair = _no_network
del _socket, _no_network
'''
NOBODY = 65534
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]


@dataclass
class Outcome:
    passed: bool
    reason: str  # "passed", "failed" (exit status), "timeout"


@functools.cache
def namespaces() -> bool:
    """Whether `unshare` can make user, network and PID namespaces here (tried once, as `nobody` when root)."""
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10,
                              preexec_fn=limits(256, 5, 8, interpreter()[1]))
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def network_isolation() -> str:
    """How this machine's sandbox keeps programs off the network, in words."""
    return "network namespace (unshare)" if namespaces() else "socket disabled by a prelude (no unshare here)"


def others_may_run(path: str) -> bool:
    """Whether a user other than the owner may execute `path` (o+x on it and on every folder above)."""
    path = Path(path).resolve()
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


@functools.cache
def interpreter() -> tuple[str, bool]:
    """(the Python that runs programs, whether it runs them as `nobody`): this one unless it is root's
    own; then the system's, if `nobody` may run it; else this one as root (no process limit)."""
    if os.getuid() != 0:
        return sys.executable, False
    for candidate in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and Path(candidate).exists() and others_may_run(candidate):
            return candidate, True
    return sys.executable, False


def limits(memory_mb: int, cpu_s: int, processes: int, as_nobody: bool = False):
    """The function the child runs before exec: its limits, and user `nobody` if it is root."""
    def apply():
        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**26, 2**26))
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
        if os.getuid() == 0 and as_nobody:  # root ignores RLIMIT_NPROC: run as nobody
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    return apply


def run_program(code: str, timeout: float = 10.0, memory_mb: int = 1024, processes: int = 32) -> Outcome:
    """Run `code` as described in the module docstring; whether it exited 0 within its limits."""
    with tempfile.TemporaryDirectory(prefix="lmforge-sandbox-") as folder:
        program = Path(folder) / "program.py"
        program.write_text(PRELUDE + code)
        os.chmod(folder, 0o755)
        os.chmod(program, 0o644)
        python, as_nobody = interpreter()
        command = [python, "-I", str(program)]
        if namespaces():
            command = [*UNSHARE, *command]
        proc = subprocess.Popen(command, cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                                preexec_fn=limits(memory_mb, max(1, int(timeout) + 1), processes, as_nobody))
        try:
            status = proc.wait(timeout=timeout)
            outcome = Outcome(status == 0, "passed" if status == 0 else "failed")
        except subprocess.TimeoutExpired:
            outcome = Outcome(False, "timeout")
        finally:
            kill_group(proc)
    return outcome


def run_programs(codes: list[str], workers: int = 4, **limits_) -> list[Outcome]:
    """run_program on each of `codes`, `workers` at a time (each in its own sandbox)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda code: run_program(code, **limits_), codes))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the program's whole process group until none of it is left (a process forked while the
    signal went out joins the group too), and reap the program."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        proc.poll()
        time.sleep(0.01)
    proc.wait()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k from n samples with c correct (see the module docstring)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, not {n}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product
