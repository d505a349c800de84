"""fp8 linears (precision/fp8.py) split by tensor parallelism (parallel/tp.py): each rank's slice of
a column- or row-parallel linear multiplies in fp8, with the per-tensor scales one process uses.

Order. The model is split first (train/setup.py step 1b: every later step wraps the split modules
as it wraps whole ones, and the weights are one process's), then the precision policy applies
(step 2), and this swap is its fp8 step for the split linears: ColumnParallelLinear and
RowParallelLinear become their fp8 forms, the same parameters, names and communication.
torchtitan applies float8 first and then tensor parallelism over the float8 linears; the result is
the same layer: the quantisation runs on each rank's slice, and f and g around it are unchanged.
The LM head stays in the autocast dtype, as in one process (precision/policy.py says why).

Scales. A per-tensor scale is a power of two from the tensor's amax (max |t|), over the WHOLE
tensor in one process. Where a rank holds only a slice, its amax is the slice's, so the slice's
amax is all-reduced (max) over the tp group first and every rank uses the whole tensor's scale:
the quantised values, hence the products, are then exactly one process's, and the only
differences left are tensor parallelism's own (the order of the fp32 sums, the row-parallel
partial products rounded to the output dtype before g sums them). What a rank holds:

    column-parallel  input x  whole (behind f)        weight  its rows: max over tp
                     grad dy  its output columns: max over tp
    row-parallel     input x  its input columns: max over tp
                     weight   its columns: max over tp  grad dy  whole (g's backward is identity)

So each split linear all-reduces two fp32 numbers per micro-batch (column: weight in forward,
gradient in backward; row: input and weight in forward), 2 x 2 x 4 = 16 ring bytes (an all-reduce
counts 2S: parallel/comm.py), under the kind "tp" with f and g: accounting/comm.py's
tensor_parallel_communication counts them ("fp8_amax"). Taking each slice's own amax instead would
cost nothing, and differ from one process less than one might think: the scales are powers of two
(fp8.py), so a slice's scale is the whole one's times 2^k, k >= 0, and a value in fp8's normal
range rounds the same at either (its mantissa does not change); only values at the bottom of the
range, subnormal at the whole tensor's scale, round differently, by at most half the smallest
subnormal at that scale: amax * 2^-10 / 224 (E4M3, whose scaled amax lies in (224, 448]) or
amax * 2^-17 / 28672 (E5M2). But the ranks' delayed-scaling histories would then differ (a
checkpoint keeps one rank's), and the numbers would no longer be one process's: the max costs
16 bytes per layer.

With fewer KV heads than ranks (a KV head replicated on tp / n_kv_heads ranks) the k and v
projections' output gradient on a rank covers its own query heads only, so the max over tp is the
max of partial gradients, not of one process's sum: those layers match within fp8 rounding only.
Sequence parallelism (the column-parallel input gathered, its shard kept for backward) is refused
with fp8 by config/rules.py: the fp8 function would keep the gathered input, not the shard.
"""

import torch.distributed as dist
import torch.nn as nn

from lmforge.parallel.tp import ColumnParallelLinear, RowParallelLinear, leave_region
from lmforge.parallel.tp_ops import TP_KIND, gather_from_region
from lmforge.precision.fp8 import HISTORY, Fp8Scales, fp8_linear, swap_linears


class _SplitFp8(Fp8Scales):
    sliced: tuple[str, ...]  # the operands a rank holds a slice of: their amax is the max over the tp group

    @classmethod
    def from_linear(cls, layer: nn.Module, scaling: str) -> "_SplitFp8":
        """`layer` in its fp8 form: its parameters (the same objects), group and settings moved over."""
        fp8 = cls.__new__(cls)
        fp8.__dict__.update(layer.__dict__)

        def max_over_tp(amax):  # a sliced operand's amax: the max over the tp group, in place
            layer.comm.all_reduce(amax, op=dist.ReduceOp.MAX, kind=TP_KIND)
        fp8.init_scales(scaling, HISTORY, dict.fromkeys(cls.sliced, max_over_tp))
        return fp8


class Fp8ColumnParallelLinear(_SplitFp8, ColumnParallelLinear):
    """A column-parallel linear multiplying in fp8: the weight's and the output gradient's amax
    over the tp group, the input's (whole) its own."""
    sliced = ("w", "grad")

    def forward(self, x):
        y = fp8_linear(x, self.weight, self.bias, self)
        return gather_from_region(y, self.comm) if self.gather_output else y


class Fp8RowParallelLinear(_SplitFp8, RowParallelLinear):
    """A row-parallel linear multiplying in fp8: the input's and the weight's amax over the tp
    group (both are column slices), the output gradient's (whole) its own."""
    sliced = ("x", "w")

    def forward(self, x):
        y = leave_region(fp8_linear(x, self.weight, None, self), self.comm, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


FP8_FORMS = {ColumnParallelLinear: Fp8ColumnParallelLinear, RowParallelLinear: Fp8RowParallelLinear}


def apply_tensor_parallel_fp8(model: nn.Module, scaling: str) -> nn.Module:
    """Swap every split linear of the blocks for its fp8 form, in place (the LM head stays);
    precision/policy.py's prepare_model does the same to whole nn.Linear layers."""
    return swap_linears(model, FP8_FORMS, scaling)
