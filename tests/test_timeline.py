"""The pipeline timeline (lmforge/parallel/timeline.py): the recorder, the measured bubble, the Chrome
trace and pipeline.png.

The bubble is checked against an ideal pipeline laid out by a small simulator here (not in the
package: the engine's real schedules live in parallel/pipeline/engine.py): every forward takes 1, every
backward 2, communication takes no time, and each action starts as soon as its stage is free and
its input has arrived. Both schedules then last (m + p - 1)(t_f + t_b) and every stage computes
m(t_f + t_b), so the measured bubble must be (p-1)/(m+p-1) exactly: the times are whole numbers and
the bubble is one division.
"""

import json
import pickle
import time

import pytest

from lmforge.accounting.pipeline import bubble_fraction
from lmforge.parallel.pipeline.timeline import KINDS, Timeline, measured_bubble, plot_timeline, write_chrome_trace

T_FORWARD, T_BACKWARD = 1.0, 2.0


def schedule(name: str, stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """The actions of one stage, in order: GPipe all forwards then all backwards; 1F1B p - s - 1
    warm-up forwards, then one forward one backward, then the remaining backwards."""
    if name == "gpipe":
        return [("forward", i) for i in range(micro_batches)] + [("backward", i) for i in range(micro_batches)]
    warmup = min(micro_batches, stages - stage - 1)
    actions, forwards = [("forward", i) for i in range(warmup)], warmup
    for i in range(micro_batches):
        if forwards < micro_batches:
            actions.append(("forward", forwards))
            forwards += 1
        actions.append(("backward", i))
    return actions


def simulate(name: str, stages: int, micro_batches: int, comm: float = 0.0) -> list[list[dict]]:
    """Each stage's events under the ideal pipeline; with comm > 0 every transfer between stages
    takes that long: a send after each action whose output goes to a neighbour, and a recv before
    each action whose input comes from one, from when the stage is free until the data is there."""
    actions = [schedule(name, stages, micro_batches, s) for s in range(stages)]
    position, free = [0] * stages, [0.0] * stages
    finished: dict[tuple[int, str, int], float] = {}
    events: list[list[dict]] = [[] for _ in range(stages)]
    while any(position[s] < len(actions[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(actions[s]):
                kind, micro = actions[s][position[s]]
                if kind == "forward":
                    source = (s - 1, "forward", micro) if s > 0 else None
                else:
                    source = (s + 1, "backward", micro) if s < stages - 1 else (s, "forward", micro)
                if source is not None and source not in finished:
                    break  # its input has not been produced yet: another stage moves first
                start = max(free[s], finished[source] if source else 0.0)
                if comm and source and source[0] != s:  # the recv blocks from the moment the stage is free
                    events[s].append({"kind": f"recv_{kind}", "micro": micro, "start": free[s], "end": start + comm})
                    start += comm
                end = start + (T_FORWARD if kind == "forward" else T_BACKWARD)
                events[s].append({"kind": kind, "micro": micro, "start": start, "end": end})
                free[s] = finished[(s, kind, micro)] = end
                if comm and ((kind == "forward" and s < stages - 1) or (kind == "backward" and s > 0)):
                    events[s].append({"kind": f"send_{kind}", "micro": micro, "start": end, "end": end + comm})
                    free[s] = end + comm
                position[s] += 1
                progressed = True
        assert progressed, "the schedule deadlocks"
    return events


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 1), (2, 2), (2, 8), (3, 5), (4, 1), (4, 4),
                                                  (4, 8), (4, 16), (8, 3)])
def test_ideal_schedule_measures_the_formula(name, stages, micro_batches):
    events = simulate(name, stages, micro_batches)
    measured = measured_bubble(events)
    assert measured["step_seconds"] == (micro_batches + stages - 1) * (T_FORWARD + T_BACKWARD)
    assert measured["bubble"] == bubble_fraction(stages, micro_batches)
    # every stage computes the same m(t_f + t_b), so each idles the formula's share
    assert measured["idle_fraction_per_stage"] == [bubble_fraction(stages, micro_batches)] * stages


def test_1f1b_simulator_holds_at_most_p_minus_s_micro_batches():
    """The simulator really runs 1F1B (not GPipe twice): stage s never has more than p - s forwards
    without their backward."""
    stages, micro_batches = 4, 8
    for stage, events in enumerate(simulate("1f1b", stages, micro_batches)):
        alive, most = 0, 0
        for e in events:
            alive += 1 if e["kind"] == "forward" else -1
            most = max(most, alive)
        assert most == stages - stage


def test_waiting_and_sending_are_idle():
    """Busy is compute only: a stage idles in its recvs and sends as in blank time; the step ends
    at the latest event of any stage, a send included."""
    events = [[{"kind": "forward", "micro": 0, "start": 0.0, "end": 1.0},
               {"kind": "send_forward", "micro": 0, "start": 1.0, "end": 1.5},
               {"kind": "recv_backward", "micro": 0, "start": 1.5, "end": 6.0},
               {"kind": "backward", "micro": 0, "start": 6.0, "end": 8.0}],
              [{"kind": "recv_forward", "micro": 0, "start": 0.0, "end": 1.5},
               {"kind": "forward", "micro": 0, "start": 1.5, "end": 2.5},
               {"kind": "backward", "micro": 0, "start": 2.5, "end": 4.5},
               {"kind": "send_backward", "micro": 0, "start": 4.5, "end": 10.0}]]
    measured = measured_bubble(events)
    assert measured["step_seconds"] == 10.0
    assert measured["idle_fraction_per_stage"] == [0.7, 0.7]
    assert measured["bubble"] == 0.7


def test_communication_time_adds_to_the_bubble():
    ideal = measured_bubble(simulate("1f1b", 4, 8))["bubble"]
    with_comm = measured_bubble(simulate("1f1b", 4, 8, comm=0.25))
    assert with_comm["bubble"] > ideal
    assert with_comm["step_seconds"] > (8 + 4 - 1) * (T_FORWARD + T_BACKWARD)


def test_timeline_records_spans_in_order_and_begin_step_forgets():
    timeline = Timeline()
    with timeline.span("forward", 0):
        pass
    with timeline.span("send_forward", 0):
        pass
    assert len(timeline.events) == 2
    time.sleep(0.1)  # so that times since the construction would be 0.1 s too late
    before = time.perf_counter()
    timeline.begin_step()
    assert timeline.events == []
    with timeline.span("recv_forward", 1):
        time.sleep(0.002)
    with timeline.span("forward", 1):
        time.sleep(0.002)
    with timeline.span("backward"):
        pass
    now = time.perf_counter()
    events = timeline.events
    assert [(e["kind"], e["micro"]) for e in events] == [("recv_forward", 1), ("forward", 1), ("backward", -1)]
    for e in events:
        assert set(e) == {"kind", "micro", "start", "end"}
        assert 0 <= e["start"] <= e["end"]
    for first, second in zip(events, events[1:]):
        assert first["end"] <= second["start"]
    # seconds since begin_step: the forward starts after a recv that slept 2 ms, and lasts its own 2 ms
    assert events[1]["start"] >= 0.002 and events[1]["end"] - events[1]["start"] >= 0.002
    assert events[-1]["end"] <= now - before
    assert pickle.loads(pickle.dumps(events)) == events  # all_gather_object sends them
    timeline.events.clear()  # a copy: the recorder keeps its own
    assert len(timeline.events) == 3


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="unknown timeline event kind 'fwd'"):
        Timeline().span("fwd", 0)


def test_chrome_trace_has_one_event_per_span(tmp_path):
    events = simulate("1f1b", 3, 4, comm=0.25)
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path, {"schedule": "1f1b", "stages": 3, "micro_batches": 4})
    trace = json.loads(path.read_text())
    assert trace["otherData"] == {"schedule": "1f1b", "stages": 3, "micro_batches": 4}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(stage) for stage in events)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    for stage, stage_events in enumerate(events):
        emitted = [e for e in spans if e["tid"] == stage]
        assert len(emitted) == len(stage_events)
        for original, e in zip(stage_events, emitted):
            assert e["pid"] == 0 and e["args"] == {"micro": original["micro"], "kind": original["kind"]}
            assert e["ts"] == pytest.approx(original["start"] * 1e6, abs=1e-6)
            assert e["dur"] == pytest.approx((original["end"] - original["start"]) * 1e6, abs=1e-6)
    labels = {(e["args"]["kind"], e["args"]["micro"]): e["name"] for e in spans}
    assert labels[("forward", 3)] == "F3" and labels[("backward", 2)] == "B2"
    assert labels[("send_forward", 1)] == "send F1" and labels[("recv_backward", 0)] == "recv B0"
    assert {e["cat"] for e in spans} == set(KINDS)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_timeline_picture_is_written(tmp_path, name):
    events = simulate(name, 4, 8, comm=0.1)
    path = tmp_path / "pipeline.png"
    plot_timeline(events, path, f"{name}, 4 stages, 8 micro-batches (simulated)", bubble_fraction(4, 8),
                  measured_bubble(events))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width = int.from_bytes(data[16:20], "big")
    assert width == 900  # README width
