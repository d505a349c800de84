"""The data-parallel strategies by name, and what each shards across the N_d ranks
(Rajbhandari et al. 2020, "ZeRO", figure 1).

lmforge/parallel/ applies a strategy to a model (the torch side); config.py validates
`train.parallel` against these names; accounting/ counts the bytes each keeps per rank and the
bytes its collectives move. A top-level module without torch, like recompute_modes.py.
"""

from dataclasses import dataclass

from lmforge.errors import lookup


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


def get_strategy(name: str) -> ParallelStrategy:
    return lookup(PARALLEL_STRATEGIES, name, "parallel strategy")
