"""A whole lmforge Transformer on a context-parallel sequence shard: `apply_context_parallel`.

A module swap from outside, like the other wrappers (the model file does not change):

  attention core   each block's `attn.core` becomes a RingAttentionCore (parallel/cp.py's ring)
  rotary tables    `model.rope` answers (start_pos=0, n) with the cos/sin rows of the shard's
                   *global* positions (zig-zag: chunks r and 2cp-1-r), not rows 0..n-1
  learned positions  (gpt) `model.pos_embeddings` looks up the same global positions; the
                   parameter keeps its name, so checkpoints are the unsharded model's
  loss             `model.loss` returns cp x this rank's share of the global mean: its targets'
                   summed cross-entropy over the whole group's target count (one 8-byte
                   all-reduce), times cp, so the ranks' losses *average* to the mean over every
                   target of the batch, however the padding and ignored targets fall across
                   ranks: each CP rank is then a data-parallel replica of its shard (torchtitan's
                   dp_cp), and an engine that averages over dp x cp ranks reduces it unchanged.
                   On a tensor-parallel model (parallel/tp.py, applied first) the summed
                   cross-entropy is the vocabulary-parallel one (parallel/tp_ops.py): it works
                   token by token over the tp group, so it sums this cp rank's tokens as the plain
                   one does, and the ring runs over the cp group on each tp rank's own heads

Sequence parallelism inside (tp x cp, parallel/tp.py's sequence_parallel): each tp rank's residual
stream holds 1/tp of its cp shard (contiguous: the first tp rank the shard's first tokens), so the
shard is padded to a multiple of tp as well (`shard`); attention all-gathers the whole cp shard over
the tp group before the ring runs on the rank's heads, so the rotary tables are the cp shard's
global positions, asked for by SequenceShardRope for tp x its tokens; the loss gathers the
normalised shard before the vocabulary-parallel head, as tensor parallelism alone does.

Everything else (embeddings, norms, MLPs, the head) works token by token and needs no change.
Every CP rank holds the whole model; each computes the gradient of its loss, the ring having
carried dK/dV home, so the model's gradient is the mean over the group (the engine's all-reduce
over the dp x cp ranks).

    cp = apply_context_parallel(model, group)         # before other wrappers (recompute, fp32 attn)
    tokens, targets = cp.shard(tokens, targets)       # the full (batch, seq) batch on every rank
    loss = model(tokens, targets); loss.backward()    # then average gradients and losses over the group

Training only: whole sequences from position 0, no KV cache; no dropout (the ring has none, and
per-rank dropout masks would not match one process's) and no sliding window.
"""

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.parallel.comm import Collectives
from lmforge.parallel.cp import RingTraffic, ring_attention, shard_batch, zigzag_positions
from lmforge.parallel.tp import SequenceShardRope
from lmforge.parallel.tp_ops import VocabParallelHeadLoss


class RingAttentionCore(nn.Module):
    """The attention core as ring attention over `group` (counting its bytes in `traffic`)."""

    def __init__(self, group, traffic: RingTraffic):
        super().__init__()
        self.group, self.traffic = group, traffic

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, self.traffic)

    def extra_repr(self) -> str:
        return f"cp={dist.get_world_size(self.group)}"


def shard_positions(local_len: int, cp: int, rank: int, limit: int, device) -> torch.Tensor:
    """The global positions of a shard of local_len tokens, clamped below `limit` (table rows): only
    end padding can pass it (shard() refuses longer real sequences), and no real token sees a pad."""
    return zigzag_positions(local_len * cp, cp, rank, device=device).clamp(max=limit - 1)


class ShardRotaryTables(nn.Module):
    """RotaryTables' cos/sin (the same buffers) at the zig-zag shard's global positions."""

    def __init__(self, tables: nn.Module, cp: int, rank: int):
        super().__init__()
        self.cp, self.rank = cp, rank
        self.register_buffer("cos", tables.cos, persistent=False)
        self.register_buffer("sin", tables.sin, persistent=False)

    def forward(self, start_pos: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start_pos != 0:
            raise LmforgeError("context parallelism runs whole sequences from position 0 (training): no KV cache")
        positions = shard_positions(seq_len, self.cp, self.rank, self.cos.shape[0], self.cos.device)
        return self.cos[positions], self.sin[positions]


class ShardPositionEmbedding(nn.Module):
    """A learned position table (gpt) read at the shard's global positions; the same parameter."""

    def __init__(self, table: nn.Embedding, cp: int, rank: int):
        super().__init__()
        self.cp, self.rank = cp, rank
        self.weight = table.weight

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        # Transformer.embed asks for arange(0, n) (start_pos 0, as ShardRotaryTables checks for rope)
        return F.embedding(shard_positions(indices.shape[0], self.cp, self.rank, self.weight.shape[0],
                                           indices.device), self.weight)


class SummedHeadLoss(nn.Module):
    """HeadLoss summed instead of averaged: model/transformer.py's cross_entropy_loss (fp32 log-softmax)."""

    def forward(self, x, norm, lm_head, targets):
        logits = lm_head(norm(x))
        return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                               targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class ContextParallelLoss(nn.Module):
    """HeadLoss's replacement: cp x the sum of this rank's cross-entropies / the group's target count.
    `summed` gives the sum: SummedHeadLoss, or a vocabulary-parallel one under tensor parallelism."""

    def __init__(self, collectives: Collectives, summed: nn.Module):
        super().__init__()
        self.collectives, self.summed = collectives, summed

    def forward(self, x, norm, lm_head, targets):
        total = self.summed(x, norm, lm_head, targets)
        return total * self.collectives.world / group_target_count(targets, self.collectives).clamp(min=1.0)


@torch.compiler.disable  # eager under train.compile: Collectives' call counters, traced, would be guards
def group_target_count(targets: torch.Tensor, collectives: Collectives) -> torch.Tensor:  # that recompile each step
    """The targets (not IGNORE_INDEX) of the whole cp group's shards: one all-reduce of one number."""
    count = (targets != IGNORE_INDEX).sum().to(torch.float32)
    collectives.all_reduce(count, kind="scalar")
    return count


@dataclass
class ContextParallel:
    """What apply_context_parallel returns: this rank's place in the CP group and its counters."""
    group: object
    cp: int
    rank: int
    max_seq_len: int
    traffic: RingTraffic = field(default_factory=RingTraffic)  # ring bytes (accounting/cp.py predicts them)
    collectives: Collectives | None = None  # the loss count
    sequence_shards: int = 1  # tp under sequence parallelism: each shard is cut again over the tp ranks

    def shard(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """This rank's zig-zag shard of a (batch, seq) batch (padded to a multiple of 2 cp, and of
        cp tp under sequence parallelism)."""
        if tokens.shape[1] > self.max_seq_len:
            raise LmforgeError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len {self.max_seq_len}")
        tokens, targets, _ = shard_batch(tokens, targets, self.cp, self.rank, self.sequence_shards)
        return tokens, targets

    def shard_every_forward(self, model: nn.Module) -> None:
        """Cut each forward's whole (batch, seq) tokens and targets to this rank's shard (a forward
        pre-hook): the trainer, its evaluation and the engines then pass whole batches, as for one
        process, and every CP rank of a replica draws the same one."""
        def shard_inputs(module, args, kwargs):
            tokens, targets = args[0], args[1] if len(args) > 1 else kwargs.pop("targets", None)
            return self.shard(tokens, targets), kwargs
        model.register_forward_pre_hook(shard_inputs, with_kwargs=True)


def ring_traffic(model: nn.Module) -> RingTraffic | None:
    """The ring's byte counter of a model under apply_context_parallel (its cores share one), else None."""
    return next((m.traffic for m in model.modules() if isinstance(m, RingAttentionCore)), None)


def apply_context_parallel(model: nn.Module, group) -> ContextParallel:
    """Swap `model`'s attention cores, positions and loss for their CP versions (module docstring)."""
    cfg = model.cfg
    if cfg.sliding_window is not None:
        raise LmforgeError(f"context parallelism does not support a sliding window (model.sliding_window="
                           f"{cfg.sliding_window}): the ring's masks are the causal ones")
    if cfg.dropout > 0:
        raise LmforgeError(f"context parallelism needs model.dropout=0 (got {cfg.dropout}): ring attention "
                           f"has no dropout, and per-rank masks would not match one process's")
    sequence_parallel = isinstance(model.rope, SequenceShardRope)  # tp.py's, applied first
    cp_state = ContextParallel(group, dist.get_world_size(group), dist.get_rank(group), cfg.max_seq_len,
                               collectives=Collectives(group),
                               sequence_shards=model.rope.parts if sequence_parallel else 1)
    for block in model.blocks.values():
        block.attn.core = RingAttentionCore(group, cp_state.traffic)
    if sequence_parallel:  # the whole cp shard's positions, asked for by tp x each tp rank's tokens
        model.rope = SequenceShardRope(ShardRotaryTables(model.rope.rope, cp_state.cp, cp_state.rank), model.rope.parts)
    elif model.rope is not None:
        model.rope = ShardRotaryTables(model.rope, cp_state.cp, cp_state.rank)
    if model.pos_embeddings is not None:
        model.pos_embeddings = ShardPositionEmbedding(model.pos_embeddings, cp_state.cp, cp_state.rank)
    model.loss = ContextParallelLoss(cp_state.collectives, _summed_loss(model.loss))
    return cp_state


def _summed_loss(loss: nn.Module) -> nn.Module:
    """The summed form of the model's head loss: vocabulary-parallel (tp x cp; a soft-capped one's
    cap kept) or plain."""
    if isinstance(loss, VocabParallelHeadLoss):
        summed = copy.copy(loss)
        summed.reduction = "sum"
        return summed
    return SummedHeadLoss()
