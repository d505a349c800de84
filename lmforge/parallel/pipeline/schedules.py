"""Pipeline schedules as lists of actions: what each rank does, in order, during one step.

An action is ("F", i, c), the forward of micro-batch i through the rank's model chunk c, or
("B", i, c), its backward. With one chunk per rank (GPipe, 1F1B) c is 0 and the rank is a stage
s; interleaved, rank s holds chunks c = 0 .. v-1, the virtual stages c p + s of p v
(pipeline/layout.py). The communication is implied by the virtual stage: a forward receives its
input from the virtual stage before (unless it is the first) and sends its output to the one after
(unless it is the last); a backward receives the gradient of its output from the one after and
sends the gradient of its input to the one before. So a schedule is just this list, and printing
it shows the technique:

    >>> one_f_one_b(stages=4, micro_batches=6, stage=0)
    [F0, F1, F2, F3, B0, F4, B1, F5, B2, B3, B4, B5]
    >>> interleaved_1f1b(stages=2, micro_batches=2, stage=1, chunks=2)   # "c1": the second chunk
    [F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]

GPipe (Huang et al. 2019, section 2.2): all m forwards, then all m backwards. Every stage holds
the activations of all m micro-batches at the turn.

1F1B (Narayanan et al. 2021, section 2.2, figure 4 top; PipeDream-Flush): stage s runs
min(p - s, m) warm-up forwards, then alternates one backward and one forward until the forwards
are done, then the remaining backwards (cool-down). A micro-batch's activations are freed by its
backward, so stage s holds at most p - s micro-batches of them: p on the first stage instead of m.
The bubble is the same as GPipe's, (p - 1) / (m + p - 1) (accounting/pipeline.py).

Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2, figure 4 bottom): each rank's forwards go
through its chunks in rounds of p micro-batches (micro-batches 0..p-1 through chunk 0, then
through chunk 1, ..., then p..2p-1 through chunk 0, ...: hence m a multiple of p), the backwards
likewise from the last chunk down. Each chunk is 1/v of the rank's layers, so the fill and drain
cost (p - 1) chunk-times instead of (p - 1) stage-times: the bubble shrinks to (p - 1) / (v m)
of the ideal time. Warm-up as Megatron-LM's: 2 (p - s - 1) + (v - 1) p + 1 forwards before the
first backward (capped at m v); the 2 (instead of 1F1B's 1) keeps a rank busy while its first
backward's gradient travels back, so communication latency does not stretch the step (played out
in tests/test_pipeline_interleaved.py). It holds that many chunk activations, about p + (p - 1) / v
micro-batches' worth on the first rank instead of 1F1B's p.

Backwards run in micro-batch order on every chunk in all three, so each parameter's gradient is
summed in the same order as one process accumulating micro-batches (train.grad_accum) sums it.
"""

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward
    micro: int
    chunk: int = 0  # which of the rank's model chunks (interleaved schedules; else 0)

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")


def gpipe(stages: int, micro_batches: int, stage: int, chunks: int = 1) -> list[Action]:
    return [Action("F", i) for i in range(micro_batches)] + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b(stages: int, micro_batches: int, stage: int, chunks: int = 1) -> list[Action]:
    warmup = min(stages - stage, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):  # steady state: the oldest backward, then the next forward
        actions += [Action("B", i), Action("F", warmup + i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


def interleaved_1f1b(stages: int, micro_batches: int, stage: int, chunks: int = 2) -> list[Action]:
    p, v, total = stages, chunks, micro_batches * chunks

    def nth(kind: str, k: int) -> Action:
        """The rank's k-th forward (or backward): round k // (p v), chunk (k // p) mod v (from the
        last chunk down for backwards), micro-batch k mod p of the round."""
        chunk = (k // p) % v
        return Action(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    warmup = min(2 * (p - stage - 1) + (v - 1) * p + 1, total)
    actions = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: the oldest backward, then the next forward
        actions += [nth("B", k), nth("F", warmup + k)]
    return actions + [nth("B", k) for k in range(total - warmup, total)]


# the names of modes/'s PIPELINE_SCHEDULES
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b}


def schedule_actions(schedule: str, stages: int, micro_batches: int, stage: int, chunks: int = 1) -> list[Action]:
    """The actions of `stage` (a rank of the pipeline) in one step of `schedule`, its model in `chunks` chunks."""
    return SCHEDULES[schedule](stages, micro_batches, stage, chunks)


def peak_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose forward has run and whose backward has not, at
    any point: micro-batches of activations with one chunk, chunk activations interleaved."""
    alive = peak = 0
    for action in actions:
        alive += 1 if action.kind == "F" else -1
        peak = max(peak, alive)
    return peak
