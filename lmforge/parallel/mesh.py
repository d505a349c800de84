"""The ranks of a run laid out as a (dp, tp) grid: tensor parallelism inside each row, data
parallelism down each column (torchtitan's ParallelDims idea, written for the two degrees lmforge
combines; Narayanan et al. 2021, section 3.2: tensor parallelism on the fastest links, so its
ranks are neighbours).

    rank = dp_index * tp + tp_index        e.g. 4 ranks, tp = 2:   tp groups {0, 1}, {2, 3}
                                                                   dp groups {0, 2}, {1, 3}

`torch.distributed.device_mesh.init_device_mesh` builds the grid and one process group per row
and per column; `ParallelGroups` hands the tp group to parallel/tp.py and the dp group to the
data-parallel engine. parallel/launch.py's `check_launch` has already refused a world size that is
not dp x tp.
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

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")


def build_groups(tp: int, device: torch.device | str = "cpu") -> ParallelGroups:
    """The (dp, tp) mesh over every rank of the initialised default group."""
    world = dist.get_world_size()
    mesh = init_device_mesh(torch.device(device).type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return ParallelGroups(mesh=mesh, tp=tp, dp=world // tp)
