"""`lmforge train --nproc N`: N local processes started through torchrun's own launcher; the
command that continues a run, as the way it was launched needs it; and the host-memory settings a
training process starts with (`retain_freed_memory`)."""

import ctypes
import ctypes.util
import os
import shlex
import signal
import sys
from pathlib import Path

from lmforge.common.last_word import said_by_launcher
from lmforge.common.errors import LmforgeError
from lmforge.config.rules import check_composition


def launch_train(args, cfg, run_dir: Path) -> int:
    """Check that `cfg` can share its work over --nproc processes, then start them, each running
    the command line typed less --nproc (and, for a new run, with the run folder named here)."""
    if cfg.train.parallel == "none" and cfg.parallel.pp == 1 and cfg.parallel.tp == 1:
        raise LmforgeError(f"--nproc {args.nproc} needs a way to share the work: add train.parallel=ddp "
                           f"(or zero1, zero2, zero3, fsdp), or parallel.tp={args.nproc}")
    # every refusal the command line and config alone decide (config/rules.py), before any rank starts
    check_composition(cfg, args.nproc)
    if "WORLD_SIZE" in os.environ:
        raise LmforgeError("--nproc under torchrun: torchrun already started the processes; drop --nproc")
    words = _without_nproc(args.argv)
    if not args.resume and not (args.name or args.out):  # one folder for all ranks, named here
        words += ["--out", str(run_dir)]
    return launch(args.nproc, words)


def launch(nproc: int, argv: list[str]) -> int:
    """torchrun's own launcher (standalone: a rendezvous on a free local port) starting N processes
    of `lmforge ARGV`; the exit status of the first that failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    options = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", "--module", "lmforge", *argv])
    os.environ[NPROC_ENV] = str(nproc)  # the ranks' resume command (resume_command) starts this launcher again
    # torchrun's agent turns SIGTERM/SIGINT into SignalException and leaves its handlers behind: a
    # late signal would then raise out of lmforge's own code (a traceback, status 1)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with said_by_launcher():  # the ranks' last lines come after torch's agent's log of their exits
            run(options)
    except ChildFailedError as err:
        code = err.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else code  # killed by signal S: 128 + S, as a shell says
    except SignalException as err:  # the launcher itself got SIGTERM/SIGINT; the ranks stopped on it too
        return 128 + err.sigval
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif not word.startswith("--nproc="):
            out.append(word)
    return out


def quiet_rank(err: LmforgeError) -> bool:
    """Under torchrun every rank stops on a bad setting, but one line is enough: the first process
    of each node prints it, and an error rank 0 reports for the whole run only rank 0 prints (unless
    rank 0 is gone: then the rank that found it out prints, parallel/world.py's ReportedHere)."""
    if getattr(err, "reported_here", False):
        return False
    return getattr(err, "reported_on_rank0", False) or os.environ.get("LOCAL_RANK", "0") != "0"


# Set by `launch` for the ranks it starts: the N of `lmforge train --nproc N`.
NPROC_ENV = "LMFORGE_NPROC"


def resume_command(command: str, run_dir: Path) -> str:
    """The command that continues `run_dir` when launched as this process was: `lmforge COMMAND
    --resume RUN` for one process, with `--nproc N` under `lmforge train --nproc N`, and under
    torchrun its options (read from the agent's command line, this process's parent) before
    `-m lmforge COMMAND --resume RUN`."""
    if "WORLD_SIZE" not in os.environ:
        return f"lmforge {command} --resume {shlex.quote(str(run_dir))}"
    if os.environ.get(NPROC_ENV):
        return f"lmforge {command} --nproc {os.environ[NPROC_ENV]} --resume {shlex.quote(str(run_dir))}"
    options = _torchrun_options(command)
    if options is None:  # no /proc: what the environment says
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        options = [f"--nnodes={int(os.environ['WORLD_SIZE']) // max(local, 1)}", f"--nproc_per_node={local}", "..."]
    line = shlex.join(["torchrun", *options, "-m", "lmforge", command, "--resume", str(run_dir)])
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    return line + (f" (on each of the {nodes} nodes, with its own torchrun options)" if nodes > 1 else "")


def _torchrun_options(command: str) -> list[str] | None:
    """torchrun's options on its command line (the parent of this rank), without the entry point
    (`-m lmforge`, or a script `.../lmforge`) and what follows it; None where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            words = [word.decode(errors="replace") for word in f.read().split(b"\0") if word]
    except OSError:
        return None
    for i in range(1, len(words)):
        if words[i] == command and Path(words[i - 1]).name == "lmforge":
            entry = i - 1 - (words[i - 2] in ("-m", "--module") if i >= 2 else 0)
            break
    else:
        return None
    # skip the launcher itself: `python -m torch.distributed.run`, `python .../torchrun`, `torchrun`
    start = next((j + 1 for j, word in enumerate(words[:entry])
                  if word in ("torch.distributed.run", "torch.distributed.launch") or Path(word).name == "torchrun"),
                 None)
    if start is None:
        return None
    return [word for word in words[start:entry] if word not in ("--no-python", "--no_python")]


# Freed host memory is kept mapped in the process (Linux, glibc), so training steps stop re-faulting it.
#
# PyTorch's CPU tensors come from malloc. glibc serves large blocks with fresh mmap() calls, unmaps
# them when they are freed, and trims the top of its heap; a training step frees and re-allocates the
# same large activations every step, so the kernel maps and zeroes those pages again, one fault per
# 4 KiB page. On the default config that is 39-43k minor page faults and ~70 ms of kernel time per
# 0.5 s step. Serving every block from the heap (M_MMAP_MAX = 0: no block gets an mmap of its own,
# whatever its size), growing the heap in large steps (M_TOP_PAD) and never trimming it keeps the
# pages (`bench/throughput.py` prints faults per step; bench/RESULTS.md). This first raised the
# mmap threshold to its ceiling, 32 MiB, instead: 14-19k faults per step on the default config and
# 4-5% faster steps than glibc's defaults, but blocks above 32 MiB still got an mmap of their own
# whenever the heap's free space ran short, and at GPT-2's vocabulary the logits (1024 x 50257
# fp32: 206 MB), their gradient and the embedding's (154 MB) are such blocks. With M_MMAP_MAX = 0,
# measured beside the threshold alone: 1.3k instead of 14k faults per step and 1.05x on the default
# config, 61k instead of 359k and 1.11x on a 4-layer GPT-2 shape (bench/RESULTS.md, issue 15).
#
# The cost is that the process keeps its peak memory until it exits, as a training process does
# anyway, plus what fragments of the heap cannot be reused for the next step's large blocks: on
# the 4-layer GPT-2 shape above the peak resident memory rose from 2.3 to 3.1 GB (the default
# config's did not move).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's <malloc.h>
MALLOC_SETTINGS = {M_MMAP_MAX: 0, M_TOP_PAD: 512 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1}


def retain_freed_memory() -> bool:
    """Apply the settings above; False (and nothing changed) where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # present in glibc only (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(option, value) == 1 for option, value in MALLOC_SETTINGS.items())
