"""What a pipeline step did, rank by rank: the recorder the engine calls around each forward,
backward, send and recv (Timeline), the bubble measured from those records, and two pictures of
them: pipeline.png (one row per stage) and a Chrome-trace JSON (chrome://tracing, ui.perfetto.dev),
written at the end of the run by `pipeline_report` (below).

Every rank records its own events against its own t0, taken right after a barrier at the start of
the step; ranks on one machine read the same clock, so the rows line up. On many machines the
barrier's skew (microseconds on one host, more across hosts) shifts a row as a whole.
"""

import json
import time
from pathlib import Path

import torch.distributed as dist

from lmforge.accounting.pipeline import bubble_fraction, virtual_split
from lmforge.config import Config

COMPUTE = ("forward", "backward")
COMMUNICATION = ("send_forward", "recv_forward", "send_backward", "recv_backward")
KINDS = COMPUTE + COMMUNICATION


class _Span:
    """One event being timed: `with timeline.span("forward", 3): ...`."""

    __slots__ = ("events", "t0", "kind", "micro", "chunk", "start")

    def __init__(self, events: list, t0: float, kind: str, micro: int, chunk: int = 0):
        self.events, self.t0, self.kind, self.micro, self.chunk = events, t0, kind, micro, chunk

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        end = time.perf_counter()
        event = {"kind": self.kind, "micro": self.micro, "start": self.start - self.t0, "end": end - self.t0}
        if self.chunk:  # interleaved schedules: which of the rank's model chunks
            event["chunk"] = self.chunk
        self.events.append(event)


class Timeline:
    """The events of one rank during the current optimizer step, in seconds since its start.

    The cost is what a span does: two perf_counter calls and an append, so it stays on in every
    pipeline run."""

    def __init__(self):
        self._events: list[dict] = []
        self._t0 = time.perf_counter()

    def begin_step(self) -> None:
        """Forget the previous step; time from now (call it right after the start-of-step barrier)."""
        self._events = []
        self._t0 = time.perf_counter()

    def span(self, kind: str, micro: int = -1, chunk: int = 0) -> _Span:
        """A context manager recording one event: `kind` one of KINDS, `micro` the micro-batch (-1:
        none), `chunk` the rank's model chunk (interleaved schedules)."""
        if kind not in KINDS:
            raise ValueError(f"unknown timeline event kind {kind!r}; one of {', '.join(KINDS)}")
        return _Span(self._events, self._t0, kind, micro, chunk)

    @property
    def events(self) -> list[dict]:
        """This step's events so far, in the order they ended: plain dicts, picklable (all_gather_object)."""
        return list(self._events)


def _busy_seconds(events: list[dict]) -> float:
    """Time a stage computes: the union of its forward and backward spans (they never overlap on
    one rank, but an overlap would otherwise count twice)."""
    total, reach = 0.0, 0.0
    for start, end in sorted((e["start"], e["end"]) for e in events if e["kind"] in COMPUTE):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def measured_bubble(events_by_stage: list[list[dict]]) -> dict:
    """The bubble of one step, measured: the step lasts from 0 (the barrier) to the latest end of
    any event on any stage, and a stage is busy while it computes (forward and backward). Waiting
    in a recv is idle, and so is a send: on this CPU's gloo a send is a copy into a socket, time
    the stage does no model work, which is what the bubble counts; the formula's ideal pipeline
    has no communication at all, so counting sends as busy would hide their cost.

    Returns {"step_seconds", "idle_fraction_per_stage", "bubble"}: the bubble is the mean of the
    stages' idle fractions, computed as all stages' idle time over stages x step, one division, so
    that an ideal schedule gives (p-1)/(m+p-1) to the last bit."""
    step = max((e["end"] for events in events_by_stage for e in events), default=0.0)
    if step <= 0:
        return {"step_seconds": 0.0, "idle_fraction_per_stage": [0.0] * len(events_by_stage), "bubble": 0.0}
    idle = [step - _busy_seconds(events) for events in events_by_stage]
    return {"step_seconds": step,
            "idle_fraction_per_stage": [i / step for i in idle],
            "bubble": sum(idle) / (len(idle) * step)}


def event_label(event: dict) -> str:
    """"F3", "B3", "send F3", "recv B3" (no number for micro -1), "F3c1" through chunk 1."""
    kind, micro = event["kind"], event["micro"]
    name = ("F" if kind.endswith("forward") else "B") + (str(micro) if micro >= 0 else "")
    name += f"c{event['chunk']}" if event.get("chunk") else ""
    return name if kind in COMPUTE else f"{kind.split('_')[0]} {name}"


def write_chrome_trace(events_by_stage: list[list[dict]], path, meta: dict) -> None:
    """The events in Chrome's trace event format: one complete ("X") event per span, ts and dur in
    microseconds, one thread per stage (named "stage s", sorted by s), `meta` under "otherData"."""
    trace = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    for stage, events in enumerate(events_by_stage):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage}"}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": stage, "args": {"sort_index": stage}})
        for e in events:
            trace.append({"name": event_label(e), "cat": e["kind"], "ph": "X", "pid": 0, "tid": stage,
                          "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                          "args": {"micro": e["micro"], "kind": e["kind"],
                                   **({"chunk": e["chunk"]} if "chunk" in e else {})}})
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta}))


# pipeline.png: forward and backward in two colours far apart, communication thin and grey so
# that idle time (left blank) reads at a glance
_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b"}
_TEXT = {"forward": "white", "backward": "black"}
_WIDTH_IN, _DPI = 9.0, 100  # 900 px: README width
_LEFT, _RIGHT = 0.8, 1.05  # inches: stage names; idle per stage
_ROW_IN, _TOP_IN, _BOTTOM_IN = 0.5, 0.75, 0.85


def plot_timeline(events_by_stage: list[list[dict]], path, title: str, formula_bubble: float,
                  measured: dict, formula_name: str = "(p-1)/(m+p-1)") -> None:
    """pipeline.png: one row per stage (stage 0 on top), a block per forward and backward labelled
    with its micro-batch where it fits, send (dark) and recv (hatched: waiting) as thin bars under
    the blocks, idle left blank; x in milliseconds; each stage's idle share at the right of its
    row, the mean beside the formula's (`formula_name`) in the title. Interleaved, odd chunks are
    drawn lighter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = len(events_by_stage)
    height = _TOP_IN + _BOTTOM_IN + _ROW_IN * max(stages, 1)
    fig = plt.figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    ax = fig.add_axes((_LEFT / _WIDTH_IN, _BOTTOM_IN / height, 1 - (_LEFT + _RIGHT) / _WIDTH_IN,
                       1 - (_TOP_IN + _BOTTOM_IN) / height))
    step_ms = measured["step_seconds"] * 1e3 or 1.0
    px_per_ms = ax.get_position().width * _WIDTH_IN * _DPI / step_ms
    for stage, events in enumerate(events_by_stage):
        for e in events:
            start, width = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
            if e["kind"] in COMPUTE:
                ax.broken_barh([(start, width)], (stage - 0.4, 0.7), facecolor=_COLOURS[e["kind"]],
                               edgecolor="white", linewidth=0.5, alpha=0.55 if e.get("chunk", 0) % 2 else 1.0)
                label = event_label(e)[1:]  # the micro-batch: the colour says F or B
                if label and width * px_per_ms >= 7 * len(label) + 4:
                    ax.text(start + width / 2, stage - 0.05, label, ha="center", va="center", fontsize=8,
                            color=_TEXT[e["kind"]])
            else:  # thin, under the compute blocks (the y axis is inverted: larger is lower)
                sending = e["kind"].startswith("send")
                ax.broken_barh([(start, width)], (stage + 0.33, 0.1), facecolor="#555555" if sending else "none",
                               edgecolor="#555555" if sending else "#999999", hatch=None if sending else "////",
                               linewidth=0.4)
        idle = measured["idle_fraction_per_stage"][stage]
        ax.text(1.01, stage, f"idle {idle:.1%}", transform=ax.get_yaxis_transform(), va="center", fontsize=9)
    ax.set_xlim(0, step_ms)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("milliseconds since the start of the step")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"{title}\nbubble measured {measured['bubble']:.3f} (mean idle of the stages), "
                 f"formula {formula_name} = {formula_bubble:.3f}", fontsize=10)
    handles = [Patch(facecolor=_COLOURS["forward"], label="forward"),
               Patch(facecolor=_COLOURS["backward"], label="backward"),
               Patch(facecolor="#555555", label="send"),
               Patch(facecolor="none", edgecolor="#999999", hatch="////", label="recv (waiting)"),
               Patch(facecolor="white", edgecolor="#cccccc", label="idle")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path)
    plt.close(fig)


# -- The end of a pipeline run: each stage's timeline of the last step and its measurements, gathered
# on rank 0 and written into the run folder beside the summary.
#
#     pipeline.png          one row per stage: forwards and backwards per micro-batch, the idle time blank
#     pipeline_trace.json   the same events for chrome://tracing or ui.perfetto.dev
#     summary.json          "pipeline": the measured bubble beside (p-1)/(m+p-1), per stage
#
# `measured_by_stage` (replica 0's rank of each stage, tensor rank 0 of it): the bytes that stage
# holds (parameters, gradients, optimizer states), the activations one micro-batch's forward saved, and the most saved
# at once during the first step ("activations_in_flight"), for the predicted-vs-measured table.


def pipeline_report(engine, events: list[dict], cfg: Config, first_step_bytes: dict, step: int, run_dir: Path,
                    is_main: bool) -> dict:
    """Gather every rank's timeline `events` (of `step`, the last) and its measurements (those of
    the session's first step, `first_step_bytes`, and the pipeline engine's); rank 0 (`is_main`)
    writes the files into `run_dir`. Every rank calls it."""
    t, layout = cfg.train, engine.layout
    mine = {"stage": layout.stage, "replica": layout.replica, "tp_rank": layout.tp_rank, "events": events,
            "bytes": {**first_step_bytes, "activations": engine.in_flight.get("one_micro_batch_bytes"),
                      "activations_in_flight": engine.in_flight.get("activation_bytes"),
                      "micro_batches_in_flight": engine.in_flight["micro_batches"]}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # one rank per stage: replica 0's, its tensor rank 0 with tp stages (the others hold as much)
    first_pipeline = sorted((r for r in everyone if r["replica"] == 0 and r["tp_rank"] == 0), key=lambda r: r["stage"])
    events_by_stage = [r["events"] for r in first_pipeline]
    # torch.distributed.pipelining's schedule (train.pipeline_engine=torch) runs without our timeline
    timed = all(events_by_stage)
    measured = measured_bubble(events_by_stage) if timed else \
        {"bubble": None, "idle_fraction_per_stage": None, "step_seconds": None}
    formula = bubble_fraction(layout.stages, t.micro_batches, layout.chunks)
    report = {"schedule": t.schedule, "engine": t.pipeline_engine, "stages": layout.stages,
              "replicas": layout.replicas, "micro_batches": t.micro_batches, "virtual_stages": layout.chunks,
              # layers per virtual stage: per stage with one chunk per rank
              "split": virtual_split(cfg.model, layout.stages, layout.chunks, t.pipeline_split, cfg.seq_len),
              "bubble_formula": formula, "bubble_measured": measured["bubble"],
              "idle_fraction_per_stage": measured["idle_fraction_per_stage"],
              "step_seconds": measured["step_seconds"], "timeline_step": step,
              "measured_by_stage": [r["bytes"] for r in first_pipeline]}
    if is_main and timed:
        title = (f"{t.schedule} pipeline: p={layout.stages} stages, m={t.micro_batches} micro-batches "
                 f"(step {step}, replica 0)")
        if layout.chunks > 1:
            title += f", v={layout.chunks} chunks per rank"
        plot_timeline(events_by_stage, run_dir / "pipeline.png", title, formula, measured,
                      "(p-1)/(vm+p-1)" if layout.chunks > 1 else "(p-1)/(m+p-1)")
        write_chrome_trace(events_by_stage, run_dir / "pipeline_trace.json",
                           {key: report[key] for key in ("schedule", "stages", "micro_batches", "bubble_formula",
                                                         "bubble_measured")})
    return report
