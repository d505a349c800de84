"""Stopping a run cleanly on SIGTERM and Ctrl-C.

Batch schedulers (Slurm, Kubernetes) send SIGTERM some seconds before SIGKILL, and Ctrl-C sends
SIGINT. Inside `StopRequests`, either one is only recorded: the training loop finishes the step
it is in, writes a checkpoint and stops (exit status 128 + the signal's number: 143, 130). A
second SIGINT means "now": it raises KeyboardInterrupt at once, as Python does by default.

Under torchrun one Ctrl-C reaches each rank twice, from the terminal (the whole foreground process
group) and forwarded by torchrun's agent a moment later: there, a SIGINT within SAME_REQUEST_SECONDS
of the first is that same request, not the second one.
"""

import os
import signal
import time

SAME_REQUEST_SECONDS = 1.0


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

    def __init__(self):
        self.received: int | None = None
        self._first_at = 0.0  # when the first request came (time.monotonic)
        self._same = SAME_REQUEST_SECONDS if "WORLD_SIZE" in os.environ else -1.0  # under torchrun
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received is not None:
            if time.monotonic() - self._first_at > self._same:
                raise KeyboardInterrupt  # the second request: do not wait for the step to end
            return  # the same Ctrl-C, forwarded by torchrun's agent
        if self.received is None:
            self._first_at = time.monotonic()
        self.received = signum

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
