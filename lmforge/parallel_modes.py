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


def shard_unit(name: str) -> str:
    """The unit a parameter is gathered and sharded with by ZeRO (parallel/zero.py) and counted
    with by accounting/comm.py: its block ("blocks.3" for "blocks.3.attn.q_proj.weight"), or
    "rest" (embeddings, final norm, head)."""
    parts = name.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "rest"
