"""How the replicas of one pipeline stage share its gradients and its optimizer: the engine the
pipeline engine (pipeline/engine.py) hands everything after the schedule to, over `data_group`,
the ranks that hold the same stage (layout.py: with N replicas and tp = 1, ranks s N .. s N + N - 1).

    ddp, none   StageReplicas        every replica keeps the stage's whole optimizer; after the
                                     schedule each gradient is all-reduced once and divided by the
                                     number of replicas (none: one replica, nothing to reduce)
    zero1       StageZero            ZeRO stage 1 (parallel/zero.py) over the stage's replicas: each
                                     holds 1/N of the stage's AdamW moments (and fp32 master weights),
                                     reduce-scatters the full gradients after the schedule, updates its
                                     slice and all-gathers the stage's parameters

Why not ZeRO-2, ZeRO-3 or FSDP (parallel/launch.py refuses them before launch): a pipeline step
runs a backward per micro-batch, so each parameter's gradient is produced m times. ZeRO-2 saves
its memory by reduce-scattering a gradient as soon as backward produces it and dropping it; here
it would either reduce-scatter m times per step (m x ZeRO-1's traffic) or keep the full gradient
until the last micro-batch, which is ZeRO-1's memory. ZeRO-3 and FSDP gather each block's
parameters before its forward and again before its backward: 2m gathers per step instead of 2,
or, kept gathered through the step, ZeRO-1's memory again. DeepSpeed refuses ZeRO-2/3 with its
pipeline engine for the same reason.

Both engines keep frozen parameters (a LoRA base) whole and out of every collective: only the
adapters' gradients cross the replicas.

A tensor-parallel stage (parallel.tp > 1) takes the same engine with tp_engine.py's
TensorParallelMixin (the pipeline engine's norm is its own, over the stages): its state by name is of whole tensors, gathered over the
tp group to save and sliced to load, and its parameter count the whole stage's.
"""

import torch
import torch.nn as nn

from lmforge.parallel.comm import Collectives
from lmforge.parallel.engine import DistributedEngine
from lmforge.parallel.tp_engine import TensorParallelMixin
from lmforge.parallel.zero import ZeroEngine


class StageReplicas(DistributedEngine):
    """train.parallel=ddp (or none) on a pipeline stage."""

    grads_sharded = False  # every replica holds the stage's whole gradients

    def trained(self) -> list[nn.Parameter]:
        return [p for p in dict.fromkeys(self.model.parameters()) if p.requires_grad and p.grad is not None]

    def finish_gradients(self) -> None:
        if self.world_size > 1:  # the mean over the replicas of this stage
            for p in self.trained():
                self.comm.all_reduce(p.grad)
                p.grad.div_(self.world_size)

    def local_pieces(self, leave_out: nn.Parameter | None = None) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient, parameter) of the stage's, but `leave_out`'s (the tied matrix's second copy, for the norm)."""
        return [(p.grad, p) for p in self.trained() if p is not leave_out]

    def local_grads(self, leave_out: nn.Parameter | None = None) -> list[torch.Tensor]:
        return [g for g, _ in self.local_pieces(leave_out)]

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class StageZero(ZeroEngine):
    """train.parallel=zero1 on a pipeline stage: ZeroEngine(stage=1) over the stage's replicas."""

    def __init__(self, model, make_optimizer, weight_decay_groups: list[dict], comm, working_dtype: torch.dtype):
        super().__init__(model, make_optimizer, weight_decay_groups, comm, 1, working_dtype)

    def local_pieces(self, leave_out: nn.Parameter | None = None) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(this rank's slice of a gradient, its parameter) for the stage's, but those of `leave_out`."""
        return [(piece.grad, unit.params[i]) for unit in self.units for i, piece in unit.piece_tensors.items()
                if unit.params[i] is not leave_out]

    def local_grads(self, leave_out: nn.Parameter | None = None) -> list[torch.Tensor]:
        return [g for g, _ in self.local_pieces(leave_out)]


class TensorParallelStageReplicas(TensorParallelMixin, StageReplicas):
    """StageReplicas of a tensor-parallel stage: whole tensors by name (tp_engine.py)."""

    def __init__(self, model, optimizer, comm: Collectives, tp_comm: Collectives):
        self.tp_comm = tp_comm
        super().__init__(model, optimizer, comm)


class TensorParallelStageZero(TensorParallelMixin, StageZero):
    """StageZero of a tensor-parallel stage: ZeRO-1 over the dp ranks of each tensor rank (as
    tp_engine.py's TensorParallelZeroEngine), whole tensors by name."""

    def __init__(self, model, make_optimizer, weight_decay_groups: list[dict], comm, working_dtype: torch.dtype,
                 tp_comm: Collectives):
        self.tp_comm = tp_comm
        super().__init__(model, make_optimizer, weight_decay_groups, comm, working_dtype)
