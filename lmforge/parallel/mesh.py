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
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelGroups:
    mesh: DeviceMesh
    tp: int  # ranks in each tensor-parallel group
    dp: int  # ranks in each data-parallel group (replicas of the model)
    cp: int = 1  # ranks in each context-parallel group (shards of each sequence)
    dp_cp_group: dist.ProcessGroup | None = None  # this rank's dp x cp ranks (same tp index); with cp > 1
    pp: int = 1  # pipeline stages

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
        return self.mesh.get_local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")


def dp_cp_ranks(dp: int, cp: int, tp: int) -> list[list[int]]:
    """Every dp x cp group's global ranks, one per tp index: the ranks that share a tp index."""
    return [[(d * cp + c) * tp + t for d in range(dp) for c in range(cp)] for t in range(tp)]


def build_groups(tp: int, device: torch.device | str = "cpu", cp: int = 1, pp: int = 1) -> ParallelGroups:
    """The (pp, dp, cp, tp) mesh over every rank of the initialised default group ((dp, cp, tp) with pp = 1)."""
    world = dist.get_world_size()
    dp = world // (pp * cp * tp)
    shape, names = ((pp,), ("pp",)) if pp > 1 else ((), ())
    mesh = init_device_mesh(torch.device(device).type, (*shape, dp, cp, tp), mesh_dim_names=(*names, "dp", "cp", "tp"))
    dp_cp_group = None
    if cp > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
        dp_cp_group, _ = dist.new_subgroups_by_enumeration(dp_cp_ranks(dp, cp, tp))
    return ParallelGroups(mesh=mesh, tp=tp, dp=dp, cp=cp, dp_cp_group=dp_cp_group, pp=pp)
