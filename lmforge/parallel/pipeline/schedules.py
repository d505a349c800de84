"""Pipeline schedules as lists of actions: what each stage does, in order, during one step.

An action is ("F", i), the forward of micro-batch i, or ("B", i), its backward. The communication
is implied by the position of the stage: a forward receives its input from the stage before
(unless it is the first) and sends its output to the stage after (unless it is the last); a
backward receives the gradient of its output from the stage after and sends the gradient of its
input to the stage before. So a schedule is just this list, and printing it shows the technique:

    >>> one_f_one_b(stages=4, micro_batches=6, stage=0)
    [F0, F1, F2, F3, B0, F4, B1, F5, B2, B3, B4, B5]

GPipe (Huang et al. 2019, section 2.2): all m forwards, then all m backwards. Every stage holds
the activations of all m micro-batches at the turn.

1F1B (Narayanan et al. 2021, section 2.2, figure 4 top; PipeDream-Flush): stage s runs
min(p - s, m) warm-up forwards, then alternates one backward and one forward until the forwards
are done, then the remaining backwards (cool-down). A micro-batch's activations are freed by its
backward, so stage s holds at most p - s micro-batches of them: p on the first stage instead of m.
The bubble is the same as GPipe's, (p - 1) / (m + p - 1) (accounting/pipeline.py).

Backwards run in micro-batch order in both, so each parameter's gradient is summed in the same
order as one process accumulating micro-batches (train.grad_accum) sums it.
"""

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}"


def gpipe(stages: int, micro_batches: int, stage: int) -> list[Action]:
    return [Action("F", i) for i in range(micro_batches)] + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Action]:
    warmup = min(stages - stage, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):  # steady state: the oldest backward, then the next forward
        actions += [Action("B", i), Action("F", warmup + i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}  # the names of modes/parallel.py's PIPELINE_SCHEDULES


def schedule_actions(schedule: str, stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The actions of `stage` in one step of `schedule`."""
    return SCHEDULES[schedule](stages, micro_batches, stage)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, at any point."""
    alive = peak = 0
    for action in actions:
        alive += 1 if action.kind == "F" else -1
        peak = max(peak, alive)
    return peak
