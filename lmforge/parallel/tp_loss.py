"""Cross-entropy over vocabulary-parallel logits, never gathering them (Shoeybi et al. 2019,
section 3: "fuse the output ... with the cross entropy loss").

Rank r holds the logits z_v of its vocabulary slice v in [start_r, start_r + V/tp) for each token.
The loss of a token with target t,

    loss = log sum_v exp(z_v - m) - (z_t - m),     m = max_v z_v,

needs three numbers over the whole vocabulary, each a reduction of per-rank ones: the maximum m
(an all-reduce of the ranks' maxima; no gradient: the loss does not depend on m), the sum of
exponentials (an all-reduce of the ranks' sums) and the target's logit (the rank holding t
contributes it, the others 0). So each rank sends 3 numbers per token instead of V/tp logits. The
two sums pass through g (all-reduce forward, identity backward: tp_ops.py): every rank computes the
same loss, and its gradient reaches each rank's logits as softmax_v - [v = t] for its own v.

A soft-capped head (model.logit_softcap, model/recipe.py) scores c tanh(z_v / c) instead of z_v:
the cap acts on each logit alone, so each rank caps its own slice before its maximum and sum of
exponentials (`VocabParallelHeadLoss`'s `cap`), and autograd multiplies the gradient by
1 - tanh^2 (z_v / c) logit by logit, as in one process.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lmforge.model.recipe import softcap
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.parallel.comm import Collectives
from lmforge.parallel.tp_ops import TP_KIND, copy_to_region, gather_sequence, linear_on_gathered, reduce_from_region


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
