"""LoRA adapters (model/lora.py) on tensor-parallel linears (parallel/tp.py), split so that the
ranks together compute one process's y = W x + (alpha / r) B A x and train its A and B.

    column-parallel W (rows = output features split):  B split by output rows, A whole.
        y_r = W_r x + s B_r (A x): x is whole behind f, so A x is the same on every rank and
        each rank keeps its output slice. A's gradient, s B_r^T dy_r x^T, is this rank's share
        of s B^T dy x^T: the ranks' are summed.
    row-parallel W (columns = input features split):   A split by input columns, B whole.
        y = g(sum_r W_r x_r) + s B g(sum_r A_r x_r): A x is a sum over the input slices, so it
        leaves the region through g (all-reduce; with sequence parallelism a reduce-scatter of
        the tokens, when B's gradient covers this rank's tokens only and is summed).

The adapters are drawn whole, exactly as one process draws them (LoRALinear reads the layer's whole
in_features / out_features), then sliced: a seed gives one process's adapters, and B starts at zero
on every rank. Each slice carries `tp_dim`, so the engine's state by name gives the whole A and B
(tp_engine.py), which checkpoints hold and a merge folds B_r A (column) or B A_r (row) into this rank's weight slice.
LoRA dropout acts on the layer's input x before A. A column-parallel rank holds the whole x and
draws the whole mask from the default generator, alike on every rank (parallel/tp_rng.py) and as
one process does. A row-parallel rank holds its slice x_r: it draws the mask of the whole width,
as one process's nn.Dropout would on the whole x, and keeps its columns (`SlicedDropout`), so the
ranks together apply one process's mask and the generator advances as one process's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.model.lora import LoRALinear, apply_lora, lora_layers
from lmforge.parallel.tp import (ColumnParallelLinear, RowParallelLinear, _sharded_parameter, _sum_gradient,
                                 leave_region, shard, shard_copies, sharded_dim)


class ColumnParallelLoRA(LoRALinear):
    """LoRA on a column-parallel linear: B_r (out / tp, r), A whole with its gradient summed."""

    def __init__(self, base: ColumnParallelLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        self.lora_B = _sharded_parameter(self.lora_B, 0, base.comm, base.copies)  # a replicated KV head's B too
        _sum_gradient(self.lora_A, base.comm)


class SlicedDropout(nn.Module):
    """Dropout on this rank's `width` of the last dimension's `width * world` features: the whole
    mask drawn as nn.Dropout draws it (F.dropout of ones is the mask, scaled by 1 / (1 - p)), this
    rank's columns kept."""

    def __init__(self, p: float, rank: int, world: int):
        super().__init__()
        self.p, self.rank, self.world = p, rank, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        mask = F.dropout(x.new_ones((*x.shape[:-1], width * self.world)), self.p, self.training)
        return x * mask.narrow(-1, self.rank * width, width)

    def extra_repr(self) -> str:
        return f"p={self.p}, rank={self.rank} of {self.world}"


class RowParallelLoRA(LoRALinear):
    """LoRA on a row-parallel linear: A_r (r, in / tp), A x summed by g before B (whole)."""

    def __init__(self, base: RowParallelLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        self.comm, self.sequence_parallel = base.comm, base.sequence_parallel
        self.lora_A = _sharded_parameter(self.lora_A, 1, base.comm)
        if base.sequence_parallel:  # B sees this rank's tokens only
            _sum_gradient(self.lora_B, base.comm)
        if dropout > 0:  # one process's mask over the whole input, this rank's columns of it
            self.dropout = SlicedDropout(dropout, base.comm.rank, base.comm.world)

    def reduce_ax(self, ax: torch.Tensor) -> torch.Tensor:
        return leave_region(ax, self.comm, self.sequence_parallel)  # sum_r A_r x_r, through g


def apply_tensor_parallel_lora(model, targets, rank: int, alpha: float | None, dropout: float = 0.0):
    """model/lora.py's apply_lora on a tensor-parallel model: the targeted column- and row-parallel
    linears wrapped in their split adapters (see the module docstring), in one process's order;
    each layer carries its tensor-parallel group."""
    def wrap(layer, *args) -> LoRALinear:
        return (ColumnParallelLoRA if isinstance(layer, ColumnParallelLinear) else RowParallelLoRA)(layer, *args)
    return apply_lora(model, targets, rank, alpha, dropout, kinds=(ColumnParallelLinear, RowParallelLinear), wrap=wrap)


def adapter_slices(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole adapters by adapter_state_dict's names (a checkpoint's, a PEFT adapter's:
    interop/peft.py) cut to the slices this rank's split layers hold: B_r of a column-parallel
    layer (a replicated KV head's: its head's rows), A_r of a row-parallel one, the rest (and a
    model without tensor parallelism) whole. Only split layers' adapters carry tp_dim, and their
    base its group."""
    layers, out = lora_layers(model), dict(state)
    for name in state:
        layer, which = name.rsplit(".", 1)
        param = getattr(layers[layer], which)
        if sharded_dim(param) is not None:
            comm, copies = layers[layer].base.comm, shard_copies(param)
            out[name] = shard(state[name], sharded_dim(param), comm.rank // copies, comm.world // copies)
    return out
