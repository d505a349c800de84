"""Placeholder until the timeline module lands (records pipeline events per rank)."""

import contextlib
import time


class Timeline:
    def __init__(self):
        self.events, self.t0 = [], time.perf_counter()

    def begin_step(self) -> None:
        self.events, self.t0 = [], time.perf_counter()

    @contextlib.contextmanager
    def span(self, kind: str, micro: int):
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            self.events.append({"kind": kind, "micro": micro, "start": start, "end": time.perf_counter() - self.t0})


def measured_bubble(events_by_stage):
    end = max(e["end"] for events in events_by_stage for e in events)
    idle = [1 - sum(e["end"] - e["start"] for e in ev if e["kind"] in ("forward", "backward")) / end
            for ev in events_by_stage]
    return {"step_seconds": end, "idle_fraction_per_stage": idle, "bubble": sum(idle) / len(idle)}


def write_chrome_trace(events_by_stage, path, meta):
    pass


def plot_timeline(events_by_stage, path, title, formula_bubble, measured):
    pass
