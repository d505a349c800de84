"""Stopping a run cleanly on SIGTERM and Ctrl-C.

Batch schedulers (Slurm, Kubernetes) send SIGTERM some seconds before SIGKILL, and Ctrl-C sends
SIGINT. Inside `StopRequests`, either one is only recorded: the training loop finishes the step
it is in, writes a checkpoint and stops (exit status 128 + the signal's number: 143, 130). An
evaluation stops between two batches (the step is saved without it), and the end-of-run sample
between two tokens (the last step is saved already): a request is never left waiting for minutes
of either; the resumed run evaluates and writes its summary. A second SIGINT means "now": it
raises KeyboardInterrupt at once, as Python does by default.

Under torchrun one Ctrl-C reaches each rank twice, from the terminal (the whole foreground process
group) and forwarded by torchrun's agent a moment later: there, a SIGINT within SAME_REQUEST_SECONDS
of the first is that same request, not the second one.

Under torchrun a rank that leaves the block on an error (a peer died, its own failure) is on its
way out, reporting: torchrun's agent sends SIGTERM to every survivor the moment it sees a rank die,
and the default action would kill the report mid-line. So there SIGTERM stays ignored after such an
exit; the agent still SIGKILLs a rank that has not exited 30 s later.

A survivor can also be stuck when that SIGTERM comes: waiting in a collective that has not noticed
the death (it would give up only after train.dist_timeout, past the agent's 30 s). Python runs a
handler between bytecodes, and the collective holds the main thread in C++, so the request is not
even recorded. Python does write the signal's number to its wakeup fd (signal.set_wakeup_fd) at
once: with `stuck` given, a watch thread reads it, and if the main thread has not recorded the
SIGTERM within STUCK_SECONDS, calls `stuck()` (the trainer's: World.report_stuck, which takes the
roll call and, if a rank is missing, says so and exits). On every SIGTERM the watch first calls
`alive()` (World.answer_roll_call): a rank in the middle of a slow step, whose main thread took the
SIGTERM at once, must still answer a stuck peer's roll call, or a plain stop of every rank (a
scheduler's SIGTERM) would read as that rank missing.
"""

import os
import signal
import socket
import threading
import time

SAME_REQUEST_SECONDS = 1.0
STUCK_SECONDS = 5.0  # a recorded SIGTERM comes within a bytecode; the roll call then takes up to 10 s of the agent's 30


class Stopped(Exception):
    """The loop stopped on a signal after saving `checkpoint` at `step`."""

    def __init__(self, signum: int, step: int, checkpoint):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopRequests:
    """Record SIGTERM and the first SIGINT while inside the `with` block (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stuck=None, alive=None):
        self.received: int | None = None
        self.agreed: int | None = None  # the request every rank acts on (agreed_by)
        self._stuck, self._alive, self._wakeup = stuck, alive, None  # see the module's docstring
        self._sigterms = 0  # SIGTERMs the main thread recorded (the watch counts those that came)
        self._first_at = 0.0  # when the first request came (time.monotonic)
        self.under_torchrun = "WORLD_SIZE" in os.environ
        self._same = SAME_REQUEST_SECONDS if self.under_torchrun else -1.0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received is not None:
            if time.monotonic() - self._first_at > self._same:
                raise KeyboardInterrupt  # the second request: do not wait for the step to end
            return  # the same Ctrl-C, forwarded by torchrun's agent
        if self.received is None:
            self._first_at = time.monotonic()
        self.received = signum
        self._sigterms += signum == signal.SIGTERM

    def agreed_by(self, world) -> int | None:
        """The request any rank received (World.stop_requested: a collective that every rank calls at
        the same point, the end of a step or of a batch of the final evaluation, a token of the
        sample); once one is agreed it stays, so every rank stops calling the collective together."""
        if self.agreed is None:
            self.agreed = world.stop_requested(self.received)
        return self.agreed

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        if self._stuck is not None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._wakeup = (reader, writer, signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(reader,), name="lmforge-stuck-watch", daemon=True).start()
        return self

    def _watch(self, reader: socket.socket) -> None:
        """The watch thread: a SIGTERM the main thread has not recorded in STUCK_SECONDS calls `stuck`."""
        came = 0
        try:
            while data := reader.recv(64):
                if not data.count(signal.SIGTERM):
                    continue
                came += data.count(signal.SIGTERM)
                if self._alive is not None:
                    self._alive()
                deadline = time.monotonic() + STUCK_SECONDS
                while self._sigterms < came and self._wakeup is not None and time.monotonic() < deadline:
                    time.sleep(0.1)
                if self._sigterms < came and self._wakeup is not None:
                    self._stuck()
        except OSError:  # closed by __exit__
            pass

    def __exit__(self, exc_type, exc, traceback):
        if self._wakeup is not None:
            reader, writer, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            writer.close()
            reader.shutdown(socket.SHUT_RDWR)  # the watch's recv returns
            reader.close()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if exc_type is not None and self.under_torchrun and not issubclass(exc_type, (Stopped, KeyboardInterrupt)):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # reporting an error: see the module's docstring

