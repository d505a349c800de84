"""The engine of a context-parallel run (parallel.cp > 1): DDP over the dp x cp ranks.

Each CP rank's loss is cp x its share of its replica's mean (parallel/cp_model.py), so the cp
ranks' losses average to that mean: to the gradient reduction every CP rank is one more
data-parallel replica, holding its shard of the sequence (torchtitan averages its gradients over
the flattened "dp_cp" mesh the same way). DDPEngine over the dp x cp group (parallel/mesh.py) then
averages them, and the global step is one process's on the whole global batch. What differs from
plain DDP is the batch:

  - every CP rank of a replica draws the same rows (the model's forward pre-hook cuts its shard):
    `replica` / `replicas` are the dp index and the dp degree, which the loader shards by;
  - `loss_divisors` counts each replica's targets once, not cp times (its cp ranks all hold the
    whole batch before the hook cuts it).

With tensor parallelism inside (tp x cp: the mesh's dp x cp x tp), the dp x cp group is that of
this rank's tp index, so each shard of a split weight is averaged with the same shard's, and
tp_engine.py's mixin adds what tp changes: the gradient norm summed over the tp group, state by
name with full tensors.
"""

import torch

from lmforge.model.transformer import IGNORE_INDEX
from lmforge.parallel.comm import Collectives
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.mesh import ParallelGroups
from lmforge.parallel.tp_engine import TensorParallelMixin


class ContextParallelDDPEngine(DDPEngine):
    """DDP over the dp x cp group of a model under apply_context_parallel (with its shard hook)."""

    def __init__(self, model, optimizer, groups: ParallelGroups, bucket_mb: float):
        comm = Collectives(groups.dp_cp_group)
        super().__init__(model, optimizer, comm, bucket_mb)
        self.cp = groups.cp
        self.replicas, self.replica = groups.dp, groups.dp_rank  # the loader's: cp ranks share rows
        comm.reset()  # setup's broadcasts are not a step's traffic

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


class TensorContextParallelDDPEngine(TensorParallelMixin, ContextParallelDDPEngine):
    """ContextParallelDDPEngine of a tensor-parallel model (tp x cp): tp_engine.py's norm and state."""

    def __init__(self, model, optimizer, groups: ParallelGroups, bucket_mb: float, tp_comm: Collectives):
        self.tp_comm = tp_comm
        super().__init__(model, optimizer, groups, bucket_mb)


def context_parallel_engine(model, optimizer, groups: ParallelGroups, bucket_mb: float,
                            tp_comm: Collectives | None) -> ContextParallelDDPEngine:
    """The engine of a cp run: DDP over dp x cp, tensor-parallel too when `tp_comm` is given."""
    if tp_comm is None:
        return ContextParallelDDPEngine(model, optimizer, groups, bucket_mb)
    return TensorContextParallelDDPEngine(model, optimizer, groups, bucket_mb, tp_comm)
