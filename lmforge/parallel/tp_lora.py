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
on every rank. Each slice carries `tp_dim`, so checkpoints hold the whole A and B by name
(tp_engine.py) and a merge folds B_r A (column) or B A_r (row) into this rank's weight slice.
LoRA dropout is refused with tensor parallelism (parallel/launch.py): a row-parallel rank would
draw its mask over its own input slice, not one process's mask.
"""

import torch

from lmforge.model.lora import LoRALinear, apply_lora
from lmforge.parallel.tp import (ColumnParallelLinear, RowParallelLinear, _sharded_parameter, _sum_gradient,
                                 leave_region)


class ColumnParallelLoRA(LoRALinear):
    """LoRA on a column-parallel linear: B_r (out / tp, r), A whole with its gradient summed."""

    def __init__(self, base: ColumnParallelLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        self.lora_B = _sharded_parameter(self.lora_B, 0, base.comm, base.copies)  # a replicated KV head's B too
        _sum_gradient(self.lora_A, base.comm)


class RowParallelLoRA(LoRALinear):
    """LoRA on a row-parallel linear: A_r (r, in / tp), A x summed by g before B (whole)."""

    def __init__(self, base: RowParallelLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        self.comm, self.sequence_parallel = base.comm, base.sequence_parallel
        self.lora_A = _sharded_parameter(self.lora_A, 1, base.comm)
        if base.sequence_parallel:  # B sees this rank's tokens only
            _sum_gradient(self.lora_B, base.comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        ax = leave_region(x.to(self.lora_A.dtype) @ self.lora_A.t(), self.comm, self.sequence_parallel)
        return y + ((ax @ self.lora_B.t()) * self.scaling).to(y.dtype)


def _wrap(layer, rank: int, alpha: float, dropout: float) -> LoRALinear:
    kind = ColumnParallelLoRA if isinstance(layer, ColumnParallelLinear) else RowParallelLoRA
    return kind(layer, rank, alpha, dropout)


def apply_tensor_parallel_lora(model, targets, rank: int, alpha: float | None, dropout: float = 0.0):
    """model/lora.py's apply_lora on a tensor-parallel model: the targeted column- and row-parallel
    linears wrapped in their split adapters (see the module docstring), in one process's order;
    each layer carries its tensor-parallel group."""
    return apply_lora(model, targets, rank, alpha, dropout, kinds=(ColumnParallelLinear, RowParallelLinear),
                      wrap=_wrap)
