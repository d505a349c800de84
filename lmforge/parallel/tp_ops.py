"""The conjugate operators of tensor parallelism (Shoeybi et al. 2019, section 3, figure 3), as
autograd Functions over a tensor-parallel group's Collectives (parallel/comm.py, which counts their
bytes under the kind "tp"), and the cross-entropy over vocabulary-parallel logits built on them
(`vocab_parallel_cross_entropy`, `VocabParallelHeadLoss`: below):

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
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lmforge.model.recipe import softcap
from lmforge.model.transformer import IGNORE_INDEX
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


# (x, comm) -> the operator's output
copy_to_region, reduce_from_region, gather_from_region = (_CopyToRegion.apply, _ReduceFromRegion.apply,
                                                          _GatherFromRegion.apply)


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


scatter_sequence = _ScatterSequence.apply  # (x, comm)


# -- Cross-entropy over vocabulary-parallel logits, never gathering them (Shoeybi et al. 2019,
# section 3: "fuse the output ... with the cross entropy loss").
#
# Rank r holds the logits z_v of its vocabulary slice v in [start_r, start_r + V/tp) for each token.
# The loss of a token with target t,
#
#     loss = log sum_v exp(z_v - m) - (z_t - m),     m = max_v z_v,
#
# needs three numbers over the whole vocabulary, each a reduction of per-rank ones: the maximum m
# (an all-reduce of the ranks' maxima; no gradient: the loss does not depend on m), the sum of
# exponentials (an all-reduce of the ranks' sums) and the target's logit (the rank holding t
# contributes it, the others 0). So each rank sends 3 numbers per token instead of V/tp logits. The
# two sums pass through g (all-reduce forward, identity backward: above): every rank computes the
# same loss, and its gradient reaches each rank's logits as softmax_v - [v = t] for its own v.
#
# A soft-capped head (model.logit_softcap, model/recipe.py) scores c tanh(z_v / c) instead of z_v:
# the cap acts on each logit alone, so each rank caps its own slice before its maximum and sum of
# exponentials (`VocabParallelHeadLoss`'s `cap`), and autograd multiplies the gradient by
# 1 - tanh^2 (z_v / c) logit by logit, as in one process.


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, comm: Collectives,
                                 vocab_start: int, reduction: str = "mean") -> torch.Tensor:
    """Mean cross-entropy over the targets that are not IGNORE_INDEX (what model/transformer.py's
    cross_entropy_loss gives for the gathered logits), from this rank's (..., V/tp) logits;
    reduction="sum": their sum (context parallelism divides by its whole group's count)."""
    logits = local_logits.flatten(0, -2).to(torch.promote_types(local_logits.dtype, torch.float32))
    targets = targets.flatten()
    with torch.no_grad():
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op=dist.ReduceOp.MAX, kind=TP_KIND)
    shifted = logits - m[:, None]
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])  # IGNORE_INDEX (negative) is nobody's
    picked = shifted.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1)
    target_logit = reduce_from_region(torch.where(mine, picked, 0.0), comm)
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), comm)
    per_token = sum_exp.log() - target_logit
    counted = targets != IGNORE_INDEX
    total = torch.where(counted, per_token, 0.0).sum()
    return total if reduction == "sum" else total / counted.sum()


class VocabParallelHeadLoss(nn.Module):
    """HeadLoss (model/transformer.py) for a vocabulary-parallel LM head: the final norm, this
    rank's logits (f on the way in: the head is a column-parallel region of its own; a soft-capped
    head's capped with `cap`, in the compute dtype as SoftcapHead caps them), the loss above.
    Parameter-free, as HeadLoss, so swapping it renames nothing. With sequence parallelism x holds
    this rank's tokens: the normalised ones are gathered on the way in."""

    def __init__(self, comm: Collectives, vocab_start: int, sequence_parallel: bool = False, reduction: str = "mean",
                 cap: float | None = None):
        super().__init__()
        self.comm, self.vocab_start, self.reduction, self.cap = comm, vocab_start, reduction, cap
        self.sequence_parallel = sequence_parallel
        self.enter = gather_sequence if sequence_parallel else copy_to_region
        self.matmul = linear_on_gathered if sequence_parallel else F.linear  # keeps the shard (tp_ops.py)

    def logits(self, x: torch.Tensor, norm: nn.Module, lm_head: nn.Module) -> torch.Tensor:
        """This rank's (..., V/tp) logits."""
        return softcap(self.matmul(self.enter(norm(x), self.comm), lm_head.weight, lm_head.bias), self.cap)

    def forward(self, x: torch.Tensor, norm: nn.Module, lm_head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self.logits(x, norm, lm_head), targets, self.comm, self.vocab_start,
                                            self.reduction)

    def extra_repr(self) -> str:
        cap = f", cap={self.cap:g}" if self.cap is not None else ""
        return f"vocab_start={self.vocab_start}, tp={self.comm.world}, reduction={self.reduction}{cap}"
