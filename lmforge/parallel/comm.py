"""The collectives the engines call, through one thin wrapper that counts what each rank sends.

Counted per call, per rank, as the ring algorithm sends it (Patarasuk & Yuan 2009; NCCL's and
gloo's ring), for a tensor of S bytes on N ranks:

    all_reduce       2 (N-1)/N S    a reduce-scatter pass, then an all-gather pass
    reduce_scatter     (N-1)/N S    S: the full (input) tensor
    all_gather         (N-1)/N S    S: the full (output) tensor
    broadcast          (N-1)/N S    (pipelined ring; only at setup)

(N-1)/N S is also the least any algorithm can send per rank for these, so the count does not
depend on which one the backend picks; the ZeRO paper's 2Psi and 3Psi are its N -> infinity
limit. accounting/comm.py predicts the same counts from the model's shapes, and a test checks
that the engines' calls add up to exactly that: no collective more, no padding unaccounted.

Every count is kept under a `kind`: "model" for the gradients and parameters of a step (what the
formula predicts), "scalar" for the few numbers a step reduces (gradient norm, found-inf, loss),
"state" for setup and checkpoints.
"""

from collections import defaultdict

import torch
import torch.distributed as dist


class Collectives:
    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ring_bytes = defaultdict(int)  # kind -> sum of S over the calls (twice for all-reduce)
        self.calls = defaultdict(int)  # (op, kind) -> number of calls

    # eager under torch.compile: traced, the counts are guards that recompile a tensor-parallel
    # block at every collective until dynamo's recompile limit sends it back to eager
    @torch.compiler.disable
    def _count(self, op: str, kind: str, tensor: torch.Tensor, passes: int = 1) -> None:
        self.ring_bytes[kind] += passes * tensor.nbytes  # read here: a traced tensor may have symbolic sizes
        self.calls[op, kind] += 1

    def sent_bytes(self, kind: str = "model") -> float:
        """Bytes this rank sent under `kind` since the last reset: (N-1)/N of the ring bytes."""
        return self.ring_bytes[kind] * (self.world - 1) / self.world

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "model", async_op: bool = False):
        self._count("all_reduce", kind, tensor, passes=2)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, kind: str = "model", async_op: bool = False):
        """shard <- rank's 1/N slice of the sum over ranks of `full` (1-D, N * shard elements)."""
        self._count("reduce_scatter", kind, full)
        return dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, kind: str = "model", async_op: bool = False):
        """full <- every rank's `shard`, concatenated in rank order."""
        self._count("all_gather", kind, full)
        return dist.all_gather_single(full, shard, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "state"):
        """From the group's rank `src` (a pipeline stage's data group is not ranks 0..N-1)."""
        self._count("broadcast", kind, tensor)
        return dist.broadcast(tensor, group=self.group, group_src=src)

    def reset(self) -> None:
        self.ring_bytes.clear()
        self.calls.clear()
