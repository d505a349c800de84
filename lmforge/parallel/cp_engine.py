"""The engines of a context-parallel run (parallel.cp > 1): DDP, ZeRO 1-3 or FSDP2 over the dp x cp ranks.

Each CP rank's loss is cp x its share of its replica's mean (parallel/cp_model.py), so the cp
ranks' losses average to that mean: to the gradient reduction every CP rank is one more
data-parallel replica, holding its shard of the sequence (torchtitan averages its gradients over
the flattened "dp_cp" mesh the same way, and shards FSDP over it: "dp_shard_cp"). So each
data-parallel engine runs unchanged over the dp x cp group (parallel/mesh.py) and the global step
is one process's on the whole global batch:

    ddp    DDPEngine    gradients all-reduced over dp x cp (bucketed, during backward)
    zero*  ZeroEngine   states sharded over dp x cp: each rank owns 1/(dp cp) of every flat unit
    fsdp   FSDPEngine   fully_shard over a 1-D mesh of the dp x cp ranks

What differs from their plain use is the batch, which `ContextParallelMixin` changes:

  - every CP rank of a replica draws the same rows (the model's forward pre-hook cuts its shard):
    `replica` / `replicas` are the dp index and the dp degree, which the loader shards by;
  - `loss_divisors` counts each replica's targets once, not cp times (its cp ranks all hold the
    whole batch before the hook cuts it).

With tensor parallelism inside (tp x cp: the mesh's dp x cp x tp), the dp x cp group is that of
this rank's tp index, so each shard of a split weight is reduced (or sharded) with the same
shard's, and tp_engine.py's engines add what tp changes: the gradient norm summed over the tp
group, state by name with full tensors. parallel/parallelize.py picks the class.
"""

import torch

from lmforge.model.transformer import IGNORE_INDEX
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.fsdp import FSDPEngine
from lmforge.parallel.mesh import ParallelGroups
from lmforge.parallel.tp_engine import TensorParallelDDPEngine, TensorParallelFSDPEngine, TensorParallelZeroEngine
from lmforge.parallel.zero import ZeroEngine


class ContextParallelMixin:
    """What cp changes in a data-parallel engine whose comm is the dp x cp group: its first
    argument is the mesh's `groups`, the rest the engine's own."""

    def __init__(self, groups: ParallelGroups, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp = groups.cp
        self.replicas, self.replica = groups.dp, groups.dp_rank  # the loader's: cp ranks share rows

    def loss_divisors(self, targets: list[torch.Tensor]) -> list[float]:
        """Engine.loss_divisors (see there), each replica's targets counted once.

        Micro-batch i's loss on a CP rank averages, over the replica's cp ranks, to the mean over
        its n_i targets; the gradients are averaged over all dp x cp ranks; so, as for plain DDP
        with `replicas` = dp, it is divided by n / (dp n_i), n the step's targets over the dp
        replicas. Summed over dp x cp ranks each replica's count comes cp times: divide by cp."""
        counts = torch.stack([(y != IGNORE_INDEX).sum() for y in targets])
        total = counts.sum()
        self.comm.all_reduce(total, kind="scalar")
        *counts, total = torch.cat([counts, total[None]]).tolist()
        return [total / (self.cp * self.replicas * n) for n in counts]


class ContextParallelDDPEngine(ContextParallelMixin, DDPEngine):
    """DDP over the dp x cp group (train.parallel=ddp)."""


class ContextParallelZeroEngine(ContextParallelMixin, ZeroEngine):
    """ZeRO stage 1, 2 or 3 over the dp x cp group (train.parallel=zero1, zero2, zero3)."""


class ContextParallelFSDPEngine(ContextParallelMixin, FSDPEngine):
    """FSDP2 over a 1-D mesh of the dp x cp ranks (train.parallel=fsdp)."""


class TensorContextParallelDDPEngine(ContextParallelMixin, TensorParallelDDPEngine):
    """tp x cp: DDP over the dp x cp group of this rank's tp index."""


class TensorContextParallelZeroEngine(ContextParallelMixin, TensorParallelZeroEngine):
    """tp x cp: ZeRO over the dp x cp group of this rank's tp index (its tp shards laid in the flat units)."""


class TensorContextParallelFSDPEngine(ContextParallelMixin, TensorParallelFSDPEngine):
    """tp x cp: FSDP2 over the dp x cp mesh of this rank's tp index."""


# train.parallel -> (the engine without tensor parallelism, the engine with it)
CONTEXT_PARALLEL_ENGINES = {
    "ddp": (ContextParallelDDPEngine, TensorContextParallelDDPEngine),
    "zero1": (ContextParallelZeroEngine, TensorContextParallelZeroEngine),
    "zero2": (ContextParallelZeroEngine, TensorContextParallelZeroEngine),
    "zero3": (ContextParallelZeroEngine, TensorContextParallelZeroEngine),
    "fsdp": (ContextParallelFSDPEngine, TensorContextParallelFSDPEngine),
}
