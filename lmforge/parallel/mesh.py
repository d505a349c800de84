"""The ranks of a run laid out as a (dp, cp, tp) grid: tensor parallelism innermost, context
parallelism inside each data-parallel replica, data parallelism outermost (torchtitan's ParallelDims
order, written for the degrees lmforge combines; Narayanan et al. 2021, section 3.2: the most
talkative parallelism on the fastest links, so tensor ranks are neighbours).

    rank = (dp_index * cp + cp_index) * tp + tp_index

    4 ranks, tp = 2:   tp groups {0, 1}, {2, 3}          4 ranks, cp = 2:   cp groups {0, 1}, {2, 3}
                       dp groups {0, 2}, {1, 3}                             dp groups {0, 2}, {1, 3}

`torch.distributed.device_mesh.init_device_mesh` builds the grid and one process group per line
of each dimension; `ParallelGroups` hands the tp group to parallel/tp.py, the cp group to
parallel/cp_model.py's ring, and the dp group (or, with cp > 1, the dp x cp group: torchtitan's
"dp_cp", over which the gradients are averaged, each cp rank a replica of its shard) to the
data-parallel engine. parallel/launch.py's `check_launch` has already refused a world size that is
not dp x cp x tp.
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


def build_groups(tp: int, device: torch.device | str = "cpu", cp: int = 1) -> ParallelGroups:
    """The (dp, cp, tp) mesh over every rank of the initialised default group."""
    world = dist.get_world_size()
    dp = world // (cp * tp)
    mesh = init_device_mesh(torch.device(device).type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    dp_cp_group = None
    if cp > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
        dp_cp_group, _ = dist.new_subgroups_by_enumeration(dp_cp_ranks(dp, cp, tp))
    return ParallelGroups(mesh=mesh, tp=tp, dp=dp, cp=cp, dp_cp_group=dp_cp_group)
