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

`torch.distributed.device_mesh.init_device_mesh` builds the grid and one process group per line
of each dimension; `ParallelGroups` hands the tp group to parallel/tp.py, the cp group to
parallel/cp_model.py's ring, and the dp group (or, with cp > 1, the dp x cp group: torchtitan's
"dp_cp", over which the gradients are averaged, each cp rank a replica of its shard) to the
data-parallel engine; a pipeline (pp > 1) takes the pp group as its pipeline and the dp group as
each stage's replicas (parallel/pipeline/engine.py). The pp dimension is in the mesh only with pp > 1
(torchtitan too leaves out a dimension of degree 1). parallel/launch.py's `check_launch` has already
refused a world size that is not pp x dp x cp x tp.

Hybrid sharding (parallel.dp_replicate and parallel.dp_shard both > 1: config/degrees.py) splits
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

from lmforge.config.degrees import mesh_degrees


@dataclass(frozen=True)
class ParallelGroups:
    mesh: DeviceMesh
    tp: int  # ranks in each tensor-parallel group
    dp: int  # ranks in each data-parallel group (replicas of the model)
    cp: int = 1  # ranks in each context-parallel group (shards of each sequence)
    dp_cp_group: dist.ProcessGroup | None = None  # this rank's dp x cp ranks (same tp index); with cp > 1
    pp: int = 1  # pipeline stages
    dp_replicate: int = 1  # > 1: hybrid sharding, the dp ranks split into dp_replicate x dp_shard

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: the dp dimension, or (dp_replicate, dp_shard) for hybrid sharding."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp") if self.pp > 1 else 0

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.mesh["cp"].get_group()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")


def dp_cp_ranks(dp: int, cp: int, tp: int) -> list[list[int]]:
    """Every dp x cp group's global ranks, one per tp index: the ranks that share a tp index."""
    return [[(d * cp + c) * tp + t for d in range(dp) for c in range(cp)] for t in range(tp)]


def build_groups(tp: int, device: torch.device | str = "cpu", cp: int = 1, pp: int = 1,
                 replicate: int = 1) -> ParallelGroups:
    """The (pp, dp, cp, tp) mesh over every rank of the initialised default group ((dp, cp, tp) with
    pp = 1); with `replicate` > 1 dp is split into (dp_replicate, dp_shard), flattened back as "dp"."""
    world = dist.get_world_size()
    dp = world // (pp * cp * tp)
    shape, names = ((pp,), ("pp",)) if pp > 1 else ((), ())
    dp_shape, dp_names = ((dp,), ("dp",)) if replicate == 1 else \
        ((replicate, dp // replicate), ("dp_replicate", "dp_shard"))
    mesh = init_device_mesh(torch.device(device).type, (*shape, *dp_shape, cp, tp),
                            mesh_dim_names=(*names, *dp_names, "cp", "tp"))
    if replicate > 1:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")  # torchtitan's way (torch's API has no public one yet)
    dp_cp_group = None
    if cp > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
        dp_cp_group, _ = dist.new_subgroups_by_enumeration(dp_cp_ranks(dp, cp, tp))
    return ParallelGroups(mesh=mesh, tp=tp, dp=dp, cp=cp, dp_cp_group=dp_cp_group, pp=pp, dp_replicate=replicate)


def hybrid_replicate(cfg) -> int:
    """parallel.dp_replicate of a hybrid-sharded launch (config/degrees.py), else 1."""
    if not (cfg.parallel.dp_replicate or cfg.parallel.dp_shard) or not dist.is_initialized():
        return 1
    degrees = mesh_degrees(cfg, dist.get_world_size())
    return degrees.dp_replicate if degrees.hybrid else 1
