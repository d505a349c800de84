"""What a rank does when the run goes wrong around it: a peer that died or hangs, a launcher that
was killed, a stop request that must reach every rank. parallel/world.py's `World` has these
methods (`Faults`); the trainer calls them.

A collective that fails names the ranks gone (`Faults.failure`), found by a roll call through the
rendezvous store (which torchrun's agent holds, so it outlives any rank), printed by rank 0 or, if
rank 0 is gone, by the lowest rank left. A rank stops with its launcher (`watch_launcher`).
"""

import contextlib
import ctypes
import os
import re
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from lmforge.common.errors import LmforgeError
from lmforge.common.last_word import say_error, say_last

# After a collective failed, how long a surviving rank waits for the others to say they are alive
# (they reach the same failure within a moment: the dead rank's sockets are closed by its kernel).
ROLL_CALL_SECONDS = 10
ROLL_CALL_POLL_SECONDS = 0.1

# prctl's option: the signal this process gets when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1
# That signal: one of its own, not SIGTERM. The kernel sends it when the *thread* that started this
# rank exits, and a SIGKILLed launcher's threads exit one by one: the signal can come while getppid()
# still names the launcher, and a SIGTERM then reads as a plain stop request (a CI failure).
LAUNCHER_DEATH_SIGNAL = signal.SIGUSR2
_LAUNCHER_GONE_SAID: list[bool] = []  # whether this process said that its launcher died
_LAUNCHER_DEATH_RECEIVED: list[bool] = []  # whether the kernel sent LAUNCHER_DEATH_SIGNAL
# Held by the one thread that reports a failure: during setup the main thread (a collective that
# failed) and the setup watch (torchrun's SIGTERM) can both find the same lost rank.
_REPORTING = threading.Lock()


class ReportedOnRank0(LmforgeError):
    """An error every rank stops on but only rank 0 prints (the CLI keeps other ranks quiet)."""

    reported_on_rank0 = True  # what the CLI reads (it does not import this module: no torch there)


class ReportedHere(LmforgeError):
    """An error this rank prints although it is not rank 0: rank 0 is gone (`World.failure`)."""

    reported_here = True  # what the CLI reads, as reported_on_rank0


class Faults:
    """World's methods for faults; World (parallel/world.py) holds rank, world_size,
    local_rank, device, launcher_pid and `distributed`."""

    def stop_requested(self, stop_signal: int | None) -> int | None:
        """A stop request any rank received, shared at the end of each step (one small all-reduce),
        so that all ranks stop after the same step: a signal reaches them at slightly different
        moments."""
        if not self.distributed:
            return stop_signal
        launcher_gone = self._launcher_gone()
        if launcher_gone:
            stop_signal = stop_signal or signal.SIGTERM  # stop as the launcher would have asked
        flags = torch.tensor([float(stop_signal == signal.SIGTERM), float(stop_signal == signal.SIGINT),
                              float(launcher_gone)], device=self.device)
        dist.all_reduce(flags)
        # some rank saw it (each checks at its own moment): its node's first process says so, once
        if flags[2] > 0 and self.local_rank == 0 and not _LAUNCHER_GONE_SAID:
            _LAUNCHER_GONE_SAID.append(True)
            print(f"rank {self.rank}: the launcher (process {self.launcher_pid}) is gone; stopping as on SIGTERM",
                  file=sys.stderr, flush=True)
        return signal.SIGTERM if flags[0] > 0 else signal.SIGINT if flags[1] > 0 else None

    def _launcher_gone(self) -> bool:
        """Whether the launcher died (the kernel said so, or this rank's parent changed)."""
        return self.launcher_pid is not None and (bool(_LAUNCHER_DEATH_RECEIVED) or os.getppid() != self.launcher_pid)

    # -- failure ---------------------------------------------------------------------------------

    def failure(self, err: BaseException, roll_call: tuple[list[int], bool] | None = None) -> LmforgeError:
        """The one-line error for a collective that failed: which ranks did not answer a roll call
        through the rendezvous store (which torchrun's agent holds, so it outlives any rank). Rank 0
        prints it; if rank 0 is among the missing, the lowest rank that answered does."""
        missing, store_lost = roll_call or self._roll_call()
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} stopped answering "
               f"(died or hangs)") if missing else "a collective failed on another rank"
        message = (f"{who}; rank {self.rank} stops too ({cause(err)}); continue from the last checkpoint "
                   f"with the same launch command and --resume")
        if self.is_main:
            return LmforgeError(message)
        # without the store nobody knows who answered: the first process of each node speaks
        reporter = self.local_rank == 0 if store_lost else self.rank == min(set(range(self.world_size)) - set(missing))
        return ReportedHere(message) if 0 in missing and reporter else ReportedOnRank0(message)

    def report_stuck(self, doing: str = "while waiting in a collective") -> None:
        """Called by the trainer's StopRequests watch (train/signals.py) when torchrun's agent sent
        SIGTERM and the main thread, waiting in a collective, did not take it: if the roll call finds
        a rank missing, print the failure's line as the CLI would and exit (status 2, the CLI's)."""
        roll_call = self._roll_call()
        if not roll_call[0]:
            return  # every rank answers: a stop request on a slow step, which the step's end takes
        error = self.failure(RuntimeError(f"stopped by torchrun's agent {doing}"), roll_call)
        if not isinstance(error, ReportedOnRank0):
            say_error(str(error))
        os._exit(2)  # the main thread is stuck in C++; the kernel drops the run folder's lock

    @contextlib.contextmanager
    def watching_setup(self):
        """World.setup_faults with more than one rank: around a run's setup (data, folder, model,
        plan: before the first step, where the trainer's StopRequests is not yet in place), a rank
        lost is said in the same one line as during training. Two ways to find out: a collective
        that fails (the main thread: the line is `failure`'s, raised), or torchrun's agent, which
        SIGTERMs the survivors the moment a rank
        dies, while this one may be waiting for rank 0 through the store (`main_first`) or working
        inside a long call: a watch thread reading Python's signal wakeup fd takes that SIGTERM,
        answers the roll call and takes it. A rank missing: the line, exit 2 (`report_stuck`);
        none: a plain stop (a scheduler's SIGTERM to every rank), exit 143 as before, said once."""
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watch decides
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch_setup, args=(reader,), name="lmforge-setup-watch", daemon=True).start()
        try:
            yield
        except Exception as err:
            if not is_collective_failure(err):
                raise
            previous = signal.SIG_IGN  # torchrun's SIGTERM must not cut the line (train/signals.py)
            _REPORTING.acquire()  # the watch may be saying it already: then it exits the process first
            raise self.failure(err) from None
        finally:
            signal.set_wakeup_fd(previous_fd)
            writer.close()
            reader.shutdown(socket.SHUT_RDWR)  # the watch's recv returns
            reader.close()
            signal.signal(signal.SIGTERM, previous)

    def _watch_setup(self, reader: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed when the setup is over
            while data := reader.recv(64):
                if data.count(signal.SIGTERM) and _REPORTING.acquire(blocking=False):
                    self.answer_roll_call()  # a rank stopped as this one is must not read as missing
                    self.report_stuck("during setup, before the first step")  # exits if a rank is missing
                    if self.is_main:
                        say_last("lmforge: stopped by SIGTERM during setup, before the first step: nothing to save")
                    os._exit(128 + signal.SIGTERM)  # as the default action did: the kernel drops the lock

    def answer_roll_call(self) -> None:
        """Say this rank is alive, for a roll call now or later (the StopRequests watch calls it on
        every SIGTERM: train/signals.py). Without the store there is nobody to tell."""
        try:
            dist.distributed_c10d._get_default_store().set(alive_key(self.rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone (its host died): the roll call says so
            pass

    def _roll_call(self) -> tuple[list[int], bool]:
        """(the ranks that did not say they are alive within ROLL_CALL_SECONDS, whether the store
        itself is gone)."""
        store = dist.distributed_c10d._get_default_store()
        # torchrun's agent sends SIGTERM to the survivors as soon as it sees a rank die: the trainer
        # only records it meanwhile (train/signals.py); the agent allows 30 s before SIGKILL
        try:
            store.set(alive_key(self.rank), "1")  # as answer_roll_call, but a lost store is said
            keys = [alive_key(rank) for rank in range(self.world_size)]
            # polled, not store.wait: a wait that times out (a rank that never answers) has torch log
            # two warnings of its own on the survivor's stderr
            deadline = time.monotonic() + ROLL_CALL_SECONDS
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(ROLL_CALL_POLL_SECONDS)
            return [rank for rank, key in enumerate(keys) if not store.check([key])], False
        except Exception:  # noqa: BLE001 - the store itself is gone (its host died)
            return [rank for rank in range(self.world_size) if rank != self.rank], True


def alive_key(rank: int) -> str:
    """The store key by which `rank` answers the roll call."""
    return f"lmforge/alive/{rank}"


# gloo's messages start with the C++ source line that raised them: "[/.../pair.cc:537] Read error ..."
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\] ")
CAUSE_CHARACTERS = 160  # a cause longer than this is cut at a word, with "...": the line stays one line


def cause(err: BaseException) -> str:
    """What a collective's (or the store's) error says, short: its first line without gloo's source
    location, up to its first sentence's end; a cut is made at a word, never inside one."""
    text = str(err).strip()
    first = _SOURCE_LOCATION.sub("", text.splitlines()[0]) if text else type(err).__name__
    first = first.split(". ", 1)[0].rstrip(".")
    if len(first) <= CAUSE_CHARACTERS:
        return first
    return first[:CAUSE_CHARACTERS].rsplit(" ", 1)[0] + "..."


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` came out of a collective (a peer gone, a timeout), not out of this rank's own
    work: torch.distributed's own error types, or gloo's and NCCL's RuntimeErrors, which name them."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(word in text for word in ("gloo", "NCCL", "Connection reset",
                                                                           "Connection closed"))


def watch_launcher() -> int:
    """Make this rank stop when the launcher that started it dies (`kill -9` of torchrun's agent
    leaves its ranks running, holding the run folder's lock): on Linux the kernel sends
    LAUNCHER_DEATH_SIGNAL (prctl PR_SET_PDEATHSIG), recorded here; `World.stop_requested` takes it,
    or a parent pid that changed (other systems, or a launcher that died before the prctl), as a
    SIGTERM. Returns the launcher's pid."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            signal.signal(LAUNCHER_DEATH_SIGNAL, lambda signum, frame: _LAUNCHER_DEATH_RECEIVED.append(True))
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, LAUNCHER_DEATH_SIGNAL, 0, 0, 0)
        except (OSError, AttributeError, ValueError):  # no prctl, or not the main thread: the per-step check remains
            pass
    return parent
