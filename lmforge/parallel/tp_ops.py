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
        parts = x.movedim(-1, 0).contiguous()
        full = parts.new_empty((comm.world * parts.shape[0], *parts.shape[1:]))
        comm.all_gather(full, parts, kind=TP_KIND)
        return full.movedim(0, -1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.world, dim=-1)[ctx.comm.rank], None


def copy_to_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, comm)


def gather_from_region(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _GatherFromRegion.apply(x, comm)


def _all_gather_dim1(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    parts = x.movedim(1, 0).contiguous()
    full = parts.new_empty((comm.world * parts.shape[0], *parts.shape[1:]))
    comm.all_gather(full, parts, kind=TP_KIND)
    return full.movedim(0, 1)


def _reduce_scatter_dim1(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    full = x.movedim(1, 0).contiguous()
    shard = full.new_empty((full.shape[0] // comm.world, *full.shape[1:]))
    comm.reduce_scatter(shard.view(-1), full.view(-1), kind=TP_KIND)
    return shard.movedim(0, 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather_dim1(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim1(grad, ctx.comm), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_dim1(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim1(grad, ctx.comm), None


def gather_sequence(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _GatherSequence.apply(x, comm)


def scatter_sequence(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    return _ScatterSequence.apply(x, comm)
