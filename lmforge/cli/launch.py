"""`lmforge train --nproc N`: N local processes started through torchrun's own launcher, and which
rank of them reports an error."""

import os
import signal
from pathlib import Path

from lmforge.common.last_word import said_by_launcher
from lmforge.common.errors import LmforgeError
from lmforge.config.rules import check_nproc


def launch_train(args, cfg, run_dir: Path) -> int:
    """Check that `cfg` can share its work over --nproc processes, then start them, each running
    the command line typed less --nproc (and, for a new run, with the run folder named here)."""
    check_nproc(cfg, args.nproc)  # every refusal the command line and config decide, before any rank starts
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
