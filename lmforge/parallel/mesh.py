"""The ranks of a run laid out as a (pp, dp, cp, tp) grid: tensor parallelism innermost, context
parallelism inside each data-parallel replica, data parallelism outside it, pipeline stages
outermost (torchtitan's ParallelDims order, written for the degrees lmforge combines; Narayanan et
al. 2021, section 3.2: the most talkative parallelism on the fastest links, so tensor ranks are
neighbours, and the pipeline's point-to-point sends, the least traffic, cross the slowest).

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

    4 ranks, pp = 2, tp = 2:  tp groups {0, 1}, {2, 3}; pp groups {0, 2}, {1, 3}: stage 0's tensor
                              rank t sends to stage 1's tensor rank t (parallel/pipeline/layout.py)

    4 ranks, tp = 2:   tp groups {0, 1}, {2, 3}          4 ranks, cp = 2:   cp groups {0, 1}, {2, 3}
                       dp groups {0, 2}, {1, 3}                             dp groups {0, 2}, {1, 3}

`torch.distributed.device_mesh.init_device_mesh` builds the grid (the dimensions of degree > 1,
and dp always: torchtitan too leaves out a dimension of degree 1) and one process group per line
of each dimension; `ParallelGroups` hands the tp group to parallel/tp.py, the cp group to
parallel/cp_model.py's ring, and the dp group (or, with cp > 1, the dp x cp group: torchtitan's
"dp_cp", over which the gradients are averaged, each cp rank a replica of its shard) to the
data-parallel engine (as `comm`, with `tp_comm`, `cp` and the loader's replicas `dp` and `dp_rank`:
every engine reads these, parallel/engine.py); a pipeline (pp > 1) takes the pp group as its
pipeline and the dp group as each stage's replicas (parallel/pipeline/engine.py).
parallel/world.py's `check_launch` has already refused a world size that is not pp x dp x cp x tp.

Hybrid sharding (parallel.dp_replicate and parallel.dp_shard both > 1: config/schema.py, Degrees) splits
the dp dimension in two, as torchtitan names them: (pp, dp_replicate, dp_shard, cp, tp), the
same rank order (dp_index = replicate_index * dp_shard + shard_index), with the two flattened
back into "dp" for the loader and the loss average; FSDP2 takes the 2-D (dp_replicate, dp_shard)
sub-mesh (`fsdp_mesh`).

    4 ranks, dp_replicate = 2, dp_shard = 2:  shard groups {0, 1}, {2, 3}; replicate groups {0, 2}, {1, 3}
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.config.schema import mesh_degrees
from lmforge.parallel.comm import Collectives

# The mesh's dimensions, outermost first (rank = the row-major index over them), written once.
# Expert parallelism (mixture-of-experts: each rank holds some of the experts, tokens sent to them
# all-to-all) comes in here, as one more dimension, not a new kind of engine. As in torchtitan it
# would borrow its ranks from dp_shard x cp (the ranks that shard the dense weights hold different
# experts instead): an `ep` degree dividing dp_shard * cp, its sub-mesh flattened from those
# dimensions in `build_groups` (as "dp" is from dp_replicate x dp_shard), and an `ep_comm` beside
# `tp_comm` in ParallelGroups, which the MoE layer and the engines read.
DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelGroups:
    """The mesh of a run and what every engine reads of it (`comm`, `tp_comm`, `cp`, `dp`,
    `dp_rank`), set once by `build_groups`; `mesh` None: one process, nothing to communicate
    (`ONE_PROCESS`: plain fields, so that a one-process run runs no code of this module)."""

    mesh: DeviceMesh | None = None
    tp: int = 1  # ranks in each tensor-parallel group
    dp: int = 1  # ranks in each data-parallel group (replicas of the model)
    cp: int = 1  # ranks in each context-parallel group (shards of each sequence)
    dp_cp_group: dist.ProcessGroup | None = None  # this rank's dp x cp ranks (same tp index); with cp > 1
    pp: int = 1  # pipeline stages
    dp_replicate: int = 1  # > 1: hybrid sharding, the dp ranks split into dp_replicate x dp_shard
    # the data-parallel engines' ranks, over which gradients are reduced (or states sharded): the
    # dp group, or with cp > 1 the dp x cp group (each cp rank one more replica of its shard)
    comm: Collectives | None = None
    tp_comm: Collectives | None = None  # the tp group's (the model's split layers and the engine share it)
    cp_group: dist.ProcessGroup | None = None  # with cp > 1
    dp_rank: int = 0  # this rank's index in its dp group (which rows the loader gives it)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: the dp dimension, (dp_replicate, dp_shard) for hybrid sharding, or with
        cp > 1 a 1-D mesh of the dp x cp ranks (torchtitan's "dp_shard_cp")."""
        if self.cp > 1:
            return DeviceMesh.from_group(self.dp_cp_group, self.mesh.device_type)
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp"]


ONE_PROCESS = ParallelGroups()


def dp_cp_ranks(dp: int, cp: int, tp: int) -> list[list[int]]:
    """Every dp x cp group's global ranks, one per tp index: the ranks that share a tp index."""
    return [[(d * cp + c) * tp + t for d in range(dp) for c in range(cp)] for t in range(tp)]


def build_groups(tp: int = 1, device: torch.device | str = "cpu", cp: int = 1, pp: int = 1,
                 replicate: int = 1) -> ParallelGroups:
    """The mesh over every rank of the initialised default group, in DIMENSIONS' order, with the
    dimensions of degree > 1 and dp always; with `replicate` > 1 dp is split into
    (dp_replicate, dp_shard), flattened back as "dp"; else dp_shard is named "dp"."""
    dp = dist.get_world_size() // (pp * cp * tp)
    sizes = dict(zip(DIMENSIONS, (pp, replicate, dp // replicate, cp, tp)))
    if replicate == 1:
        sizes = {("dp" if name == "dp_shard" else name): n for name, n in sizes.items() if name != "dp_replicate"}
    sizes = {name: n for name, n in sizes.items() if n > 1 or name == "dp"}
    mesh = init_device_mesh(torch.device(device).type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    if replicate > 1:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")  # torchtitan's way (torch's API has no public one yet)
    dp_cp_group = None
    if cp > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
        dp_cp_group, _ = dist.new_subgroups_by_enumeration(dp_cp_ranks(dp, cp, tp))
    return ParallelGroups(mesh=mesh, tp=tp, dp=dp, cp=cp, dp_cp_group=dp_cp_group, pp=pp, dp_replicate=replicate,
                          comm=Collectives(dp_cp_group if cp > 1 else mesh["dp"].get_group()),
                          tp_comm=Collectives(mesh["tp"].get_group()) if tp > 1 else None,
                          cp_group=mesh["cp"].get_group() if cp > 1 else None, dp_rank=mesh["dp"].get_local_rank())


def hybrid_replicate(cfg) -> int:
    """parallel.dp_replicate of a hybrid-sharded launch (config/schema.py, Degrees), else 1."""
    if not (cfg.parallel.dp_replicate or cfg.parallel.dp_shard) or not dist.is_initialized():
        return 1
    degrees = mesh_degrees(cfg, dist.get_world_size())
    return degrees.dp_replicate if degrees.hybrid else 1
