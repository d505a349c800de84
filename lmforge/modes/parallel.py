"""The data-parallel strategies by name, and what each shards across the N_d ranks
(Rajbhandari et al. 2020, "ZeRO", figure 1).

lmforge/parallel/ applies a strategy to a model (the torch side); config/validate.py validates
`train.parallel` against these names; accounting/ counts the bytes each keeps per rank and the
bytes its collectives move. A module without torch, like modes/recompute.py.
"""

from dataclasses import dataclass

from lmforge.common.errors import LmforgeError, lookup


@dataclass(frozen=True)
class ParallelStrategy:
    name: str
    zero_stage: int  # 0: nothing sharded; 1: optimizer states; 2: + gradients; 3: + parameters
    description: str


PARALLEL_STRATEGIES: dict[str, ParallelStrategy] = {s.name: s for s in (
    ParallelStrategy("none", 0, "one process"),
    ParallelStrategy("ddp", 0, "replicate everything; all-reduce gradients in buckets during backward"),
    ParallelStrategy("zero1", 1, "shard optimizer states (and fp32 master weights)"),
    ParallelStrategy("zero2", 2, "shard optimizer states and gradients (reduce-scatter)"),
    ParallelStrategy("zero3", 3, "shard optimizer states, gradients and parameters (gather per block)"),
    ParallelStrategy("fsdp", 3, "PyTorch FSDP2 fully_shard per block: the production path"),
)}


# The named sets the rest of lmforge uses, derived here (tests/test_registries.py checks that every list
# of strategies outside modes/ is one of these objects)
SHARDING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage > 0)  # zero1-3, fsdp
REPLICATING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage == 0)  # none, ddp: whole states
DATA_PARALLEL = tuple(name for name in PARALLEL_STRATEGIES if name != "none")  # share the work of N ranks
# what a pipeline stage's replicas can use: a pipeline step runs one backward per micro-batch, and
# only a strategy that shards no more than the optimizer states communicates once a step
STAGE_REPLICAS = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage <= 1)  # none, ddp, zero1
PARAMETER_SHARDING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage == 3)  # zero3, fsdp


def names(choices) -> str:
    """'a, b or c': the names of a set, for a message."""
    choices = list(choices)
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)


def get_strategy(name: str) -> ParallelStrategy:
    return lookup(PARALLEL_STRATEGIES, name, "parallel strategy")


def shard_unit(name: str) -> str:
    """The unit a parameter is gathered and sharded with by ZeRO (parallel/zero.py) and counted
    with by accounting/comm.py: its block ("blocks.3" for "blocks.3.attn.q_proj.weight"), or
    "rest" (embeddings, final norm, head)."""
    parts = name.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "rest"


# -- pipeline parallelism (lmforge/parallel/pipeline/engine.py) -----------------------------------------

@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    description: str


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (
    # Huang et al. 2019: every micro-batch's forward, then every backward; m micro-batches of
    # activations alive on every stage at the turn
    PipelineSchedule("gpipe", "all forwards, then all backwards (GPipe)"),
    # Narayanan et al. 2021, section 2.2: after a warm-up, one forward then one backward; stage s keeps
    # at most p - s micro-batches of activations alive; the same bubble as GPipe
    PipelineSchedule("1f1b", "warm-up forwards, then one forward one backward (1F1B)"),
    # Narayanan et al. 2021, section 2.2.2: each rank holds train.pipeline_virtual_stages chunks (round
    # robin); the bubble shrinks v-fold, for v times the point-to-point traffic
    PipelineSchedule("interleaved-1f1b", "1F1B over v model chunks per rank (interleaved 1F1B)"),
)}

PIPELINE_ENGINES = {"lmforge": "our schedules on send/recv (parallel/pipeline/engine.py)",
                    "torch": "torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B"}


def parse_split(text: str, n_layers: int, stages: int) -> list[int] | None:
    """`train.pipeline_split` as layers per stage ("4,4,4,4" -> [4, 4, 4, 4]), checked against the
    model; None for "" (the split is then balanced by cost: accounting/pipeline.py)."""
    if stages > n_layers:
        raise LmforgeError(f"parallel.pp={stages} but the model has {n_layers} layers: each stage needs "
                           f"at least one; use at most {n_layers} stages")
    if not text.strip():
        return None
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        raise LmforgeError(f"train.pipeline_split={text!r} is not a list of layer counts: write e.g. "
                           f"\"{','.join(['2'] * stages)}\"") from None
    if len(split) != stages or sum(split) != n_layers or min(split) < 1:
        raise LmforgeError(f"train.pipeline_split={text} must give each of the {stages} stages at least one layer "
                           f"and {n_layers} layers in all (the model's model.n_layers)")
    return split
