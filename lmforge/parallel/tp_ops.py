"""The conjugate operators of tensor parallelism (Shoeybi et al. 2019, section 3, figure 3), as
autograd Functions over a tensor-parallel group's Collectives (parallel/comm.py, which counts their
bytes under the kind "tp"):

    f  copy_to_region      identity forward, all-reduce backward (a parallel region's entry)
    g  reduce_from_region  all-reduce forward, identity backward (its exit)
    gather_from_region     all-gather of the last dimension forward, this rank's slice backward

f and g are each other's transpose: what one communicates in forward the other does in backward.

With sequence parallelism (Korthikanti et al. 2022, section 4.2.2, figure 5) the residual stream
between the regions is split along the sequence (dimension 1), and f and g become their
sequence-parallel pair, again each other's transpose; an all-reduce is a reduce-scatter followed
by an all-gather, so the bytes sent are those of f and g:

    gather_sequence        all-gather of dimension 1 forward, reduce-scatter backward  (f's place)
    scatter_sequence       reduce-scatter of dimension 1 forward, all-gather backward  (g's place)

The column-parallel linears behind gather_sequence multiply the gathered input but keep only this
rank's shard of it for backward (`linear_on_gathered`), and backward all-gathers the shard again
for the weight gradients, once per region (Korthikanti et al. 2022, section 4.2.2: "we store only
the sequence-parallel part ... and perform an extra all-gather in the backward pass"); otherwise
the input the norm split tp ways is kept whole again. That re-gather costs one more all-gather of
the region's input per region per step, counted under TP_KIND like the others.
"""

import torch

from lmforge.parallel.comm import Collectives

TP_KIND = "tp"  # the Collectives kind under which tensor-parallel activations are counted


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, kind=TP_KIND)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x, kind=TP_KIND)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return all_gather_along(x, -1, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.world, dim=-1)[ctx.comm.rank], None


def copy_to_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, comm)


def gather_from_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _GatherFromRegion.apply(x, comm)


def all_gather_along(x: torch.Tensor, dim: int, comm: Collectives, kind: str = TP_KIND) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order (one all-gather counted under `kind`)."""
    parts = x.movedim(dim, 0).contiguous()
    full = parts.new_empty((comm.world * parts.shape[0], *parts.shape[1:]))
    comm.all_gather(full, parts, kind=kind)
    return full.movedim(0, dim)


def _reduce_scatter_dim1(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    full = x.movedim(1, 0).contiguous()
    shard = full.new_empty((full.shape[0] // comm.world, *full.shape[1:]))
    comm.reduce_scatter(shard.view(-1), full.view(-1), kind=TP_KIND)
    return shard.movedim(0, 1)


class _Regather:
    """A region's gathered input in backward: all-gathered from the shard by the first of the
    region's linears to need it, shared by the others, dropped when the region's entry (the
    all-gather's backward, which runs after all of them) is reached."""

    def __init__(self, comm: Collectives):
        self.comm, self.full = comm, None

    def get(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = all_gather_along(shard, 1, self.comm)
        return self.full


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, regather):
        ctx.comm, ctx.regather = comm, regather
        return all_gather_along(x, 1, comm)

    @staticmethod
    def backward(ctx, grad):
        ctx.regather.full = None
        return _reduce_scatter_dim1(grad, ctx.comm), None, None


class _LinearOnGathered(torch.autograd.Function):
    """y = x W^T + b for the gathered x, keeping x's sequence shard (not x) for dW = dy^T x."""

    @staticmethod
    def forward(ctx, full, shard, regather, weight, bias):
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias = regather, bias is not None
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        full = ctx.regather.get(shard)
        # under autocast the forward multiplied in grad's dtype: backward does too, returning
        # each gradient in its input's dtype
        rows, inputs = grad.reshape(-1, grad.shape[-1]), full.reshape(-1, full.shape[-1]).to(grad.dtype)
        grad_bias = rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        grad_full = (grad @ weight.to(grad.dtype)).to(full.dtype)
        return grad_full, None, None, (rows.t() @ inputs).to(weight.dtype), grad_bias
class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_dim1(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 1, ctx.comm), None


def gather_sequence(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """The whole sequence from each rank's shard; it carries the shard for `linear_on_gathered`."""
    regather = _Regather(comm)
    full = _GatherSequence.apply(x, comm, regather)
    full.sequence_shard = (x, regather)
    return full


def linear_on_gathered(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(full, weight, bias) for `full` from gather_sequence, keeping its shard for backward."""
    shard, regather = full.sequence_shard
    return _LinearOnGathered.apply(full, shard, regather, weight, bias)


def scatter_sequence(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _ScatterSequence.apply(x, comm)
