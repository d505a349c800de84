"""Tensor parallelism written out (Megatron-LM: Shoeybi et al. 2019, section 3).

Each of the `tp` ranks of a tensor-parallel group holds a 1/tp slice of every large matrix and
computes its share of every block; the ranks exchange activations, not gradients. Two conjugate
operators mark where a parallel region starts and ends (the paper's f and g, its figure 3):

    f  identity in forward, all-reduce in backward   enters a region: every rank reads the whole x,
                                                     and dL/dx is the sum of the ranks' partial ones
    g  all-reduce in forward, identity in backward   leaves a region: the ranks' partial outputs summed

An MLP Y = act(X A) B is split with A by columns and B by rows (section 3, eq. 3): each rank
computes act(X A_r) B_r with no communication in between, and g sums the partial products. The
attention layer is split the same way by heads: each rank projects its q, k and v heads (columns
of W_q, W_k, W_v), attends over them, and multiplies by its rows of W_o. So a block costs two
all-reduces in forward (the two g) and two in backward (the two f).

    Attention   q_proj, k_proj, v_proj  column-parallel (heads split; grouped-query: KV heads too)
                o_proj                  row-parallel, then g
    SwiGLU      gate_proj, up_proj      column-parallel;  down_proj row-parallel, then g
    GELU, ReLU^2 up_proj                column-parallel;  down_proj row-parallel, then g
    embedding   rows split by vocabulary; a rank looks up the tokens in its range, zeros the rest,
                and g sums (section 3, "input embedding")
    LM head     rows split by vocabulary (tied: the embedding's own slice); the loss is taken over
                the split logits without gathering them (tp_ops.py); a soft-capped head caps
                each rank's logits (model.logit_softcap acts on each logit alone)

Norms, biases of row-parallel layers and position tables stay whole on every rank: the activations
they touch are the same on every rank, and so are their gradients. A QK-norm gain reads only this
rank's heads, so its gradient is a partial sum, all-reduced by a hook.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): between the regions the residual
stream is split along the sequence too, so the norms run on 1/tp of the tokens; f becomes an
all-gather of the sequence and g a reduce-scatter (tp_ops.py), and the whole parameters outside the
regions (norm gains, row-parallel biases) see only this rank's tokens, so their gradients are summed
by a hook. The rotary tables are asked for the whole sequence (`SequenceShardRope`).

Grouped-query attention with fewer KV heads than ranks replicates each KV head over tp / n_kv_heads
ranks (as Megatron-LM does): a rank's query heads all read one KV head, so k_proj and v_proj are cut
into n_kv_heads slices and rank r keeps slice r // (tp / n_kv_heads). Each copy's gradient covers
its own rank's query heads only, so the copies' gradients are summed (`sum_over_copies`); f already
sums the input gradient over every rank, which counts each copy's share once. The plan counts its
shapes, saved k and v and the copies' all-reduce (accounting/shapes.py, memory.py, comm.py). Under
FSDP2, whose new parameters drop the hook, tp_engine.py sums the copies' gradient shards after
backward; under context parallelism each tp rank's ring carries its one (copied) KV head.

`apply_tensor_parallel` is a module swap applied from outside (train/setup.py, step 1b): each
parallel module is built from the nn.Linear or nn.Embedding it replaces, keeping its slice of the
full weight, so a seed gives exactly the model one process trains. Where a region starts, a forward
pre-hook applies f to the region's input (once for q, k and v together, once for gate and up): the
module tree and the parameter names stay those of the model (`blocks.0.attn.q_proj.weight`).
Each sharded parameter carries `tp_dim`, the dimension it is split along, and a replicated KV
head's `tp_copies` (tp_engine.py gathers and slices checkpoints by them).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.common.errors import LmforgeError
from lmforge.model.recipe import ReLU2MLP, SoftcapHead, softcap
from lmforge.model.transformer import Attention, GeluMLP, SwiGLU, Transformer
from lmforge.parallel.comm import Collectives
from lmforge.config.rules import tp_divisibility
from lmforge.parallel.tp_ops import (TP_KIND, VocabParallelHeadLoss, copy_to_region, gather_from_region,
                                     gather_sequence, linear_on_gathered, reduce_from_region, scatter_sequence)
from lmforge.parallel.tp_rng import apply_tensor_rank_rng

def shard(tensor: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/parts slice of `tensor` along `dim` (a copy: the full one can go)."""
    if tensor.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of shape {tuple(tensor.shape)} does not split into {parts} parts")
    return tensor.chunk(parts, dim=dim)[rank].clone()


def _sharded_parameter(full: torch.Tensor, dim: int, comm: Collectives, copies: int = 1) -> nn.Parameter:
    """This rank's slice of `full` along `dim`; with `copies` > 1, `copies` neighbouring ranks hold
    the same slice (a replicated KV head) and its gradient is summed over them."""
    param = nn.Parameter(shard(full.detach(), dim, comm.rank // copies, comm.world // copies),
                         requires_grad=full.requires_grad)
    param.tp_dim = dim
    if copies > 1:
        param.tp_copies = copies
        if param.requires_grad:  # FSDP2 replaces the parameter, and the hook with it: tp_engine.py sums it then
            param.register_hook(lambda grad: sum_over_copies(grad, comm, copies))
    return param


def leave_region(y: torch.Tensor, comm: Collectives, sequence_parallel: bool) -> torch.Tensor:
    """g: the ranks' partial outputs summed, whole on every rank, or (sequence parallelism) summed
    and split along the sequence, each rank keeping its tokens."""
    return scatter_sequence(y, comm) if sequence_parallel else reduce_from_region(y, comm)


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r (+ b_r): this rank's output features (rows of nn.Linear's weight, which is A^T).
    Its input is already the whole X behind f (the region's pre-hook); `gather_output` all-gathers
    Y (the LM head's logits for generation; a soft-capped head, model/recipe.py's SoftcapHead, caps
    each rank's own logits with `cap` first: c tanh(z / c) acts on each logit alone). With
    `sequence_parallel` X is gathered from the ranks' sequence shards, and only this rank's shard
    is kept for backward (tp_ops.py). With `copies` > 1 the output is cut into world / copies
    slices, each held by `copies` ranks."""

    def __init__(self, linear: nn.Linear, comm: Collectives, gather_output: bool = False,
                 sequence_parallel: bool = False, copies: int = 1, cap: float | None = None):
        super().__init__()
        self.comm, self.gather_output, self.copies, self.cap = comm, gather_output, copies, cap
        self.matmul = linear_on_gathered if sequence_parallel else F.linear
        self.weight = _sharded_parameter(linear.weight, 0, comm, copies)
        self.bias = _sharded_parameter(linear.bias, 0, comm, copies) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = softcap(self.matmul(x, self.weight, self.bias), self.cap)
        return gather_from_region(y, self.comm) if self.gather_output else y

    # the whole layer's sizes (model/lora.py's LoRALinear draws its adapters at them: parallel/tp_lora.py)
    in_features = property(lambda self: self.weight.shape[1])
    out_features = property(lambda self: self.weight.shape[0] * self.comm.world // self.copies)

    def extra_repr(self) -> str:
        copies = f", copies={self.copies}" if self.copies > 1 else ""
        cap = f", cap={self.cap:g}" if self.cap is not None else ""
        return f"out_features={self.weight.shape[0]} of {self.out_features}, tp={self.comm.world}{copies}{cap}"


class RowParallelLinear(nn.Module):
    """Y = g(sum_r X_r B_r) + b: this rank's input features (columns of the weight); the bias,
    whole on every rank, is added once after the sum (to this rank's tokens, with sequence
    parallelism)."""

    def __init__(self, linear: nn.Linear, comm: Collectives, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _sharded_parameter(linear.weight, 1, comm)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.comm, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    in_features = property(lambda self: self.weight.shape[1] * self.comm.world)  # the whole layer's
    out_features = property(lambda self: self.weight.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]} of {self.weight.shape[1] * self.comm.world}, tp={self.comm.world}"


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_start + V/tp of the table; tokens outside look up zeros, and g sums
    the ranks' lookups into the whole embedding (split along the sequence: sequence parallelism)."""

    def __init__(self, embedding: nn.Embedding, comm: Collectives, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _sharded_parameter(embedding.weight, 0, comm)
        self.vocab_start = comm.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_region(rows.masked_fill(outside[..., None], 0.0), self.comm, self.sequence_parallel)


def _entering(comm: Collectives, sequence_parallel: bool):
    """A forward pre-hook that applies f to a region's first input (the residual stream's x): the
    whole input on every rank (gathered along the sequence under sequence parallelism)."""
    enter = gather_sequence if sequence_parallel else copy_to_region

    def hook(module, args):
        return (enter(args[0], comm), *args[1:])
    return hook


def _sum_gradient(param: nn.Parameter, comm: Collectives) -> None:
    """A whole parameter used on this rank's heads (or tokens) only: its gradient is the sum of the ranks'."""
    def hook(grad):
        grad = grad.clone()
        comm.all_reduce(grad, kind=TP_KIND)
        return grad
    param.register_hook(hook)
    param.tp_summed = True  # FSDP2 replaces the parameter, and the hook with it: tp_engine.py sums it then


def sum_over_copies(grad: torch.Tensor, comm: Collectives, copies: int) -> torch.Tensor:
    """The sum of `grad` over the `copies` ranks holding the same slice (a replicated KV head): each
    rank's gradient covers its own query heads, the slice's is their sum. One all-reduce over the tp
    group of every slice's slot, zeros but this rank's: world / copies times the slice's bytes, where
    an all-reduce within the copies alone would send it once, but no second process group to build,
    order and time out. The same on FSDP2's dp shard of the gradient (tp_engine.py): the copies'
    shards are alike, as their parameters are."""
    slots = grad.new_zeros((comm.world // copies, *grad.shape))
    slots[comm.rank // copies] = grad
    comm.all_reduce(slots, kind=TP_KIND)
    return slots[comm.rank // copies].clone()  # a view would keep every slot alive as the gradient's storage


class SequenceShardRope(nn.Module):
    """The rotary tables for the whole sequence when the residual stream holds 1/tp of it
    (`Transformer.run_blocks` asks for x.shape[1] positions); attention reads them after the
    all-gather, over every position. Its buffers are not saved: no state name changes."""

    def __init__(self, rope: nn.Module, parts: int):
        super().__init__()
        self.rope, self.parts = rope, parts

    def forward(self, start_pos: int, seq_len: int):
        return self.rope(start_pos, seq_len * self.parts)


def _split_attention(attn: Attention, comm: Collectives, sp: bool) -> None:
    tp = comm.world
    copies = max(tp // attn.n_kv_heads, 1)  # ranks per KV head: more than 1 with fewer KV heads than ranks
    attn.q_proj = ColumnParallelLinear(attn.q_proj, comm, sequence_parallel=sp)
    for name in ("k_proj", "v_proj"):
        setattr(attn, name, ColumnParallelLinear(getattr(attn, name), comm, sequence_parallel=sp, copies=copies))
    attn.o_proj = RowParallelLinear(attn.o_proj, comm, sp)
    attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads * copies // tp  # this rank's heads
    for norm in (attn.q_norm, attn.k_norm):
        for param in norm.parameters():
            _sum_gradient(param, comm)
    attn.register_forward_pre_hook(_entering(comm, sp))


def _split_mlp(mlp: nn.Module, comm: Collectives, sp: bool) -> None:
    for name in ("gate_proj", "up_proj"):
        if hasattr(mlp, name):
            setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), comm, sequence_parallel=sp))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, comm, sp)
    mlp.register_forward_pre_hook(_entering(comm, sp))


def apply_tensor_parallel(model: Transformer, comm: Collectives, sequence_parallel: bool = False) -> Transformer:
    """Swap `model`'s layers for their tensor-parallel slices over `comm`'s group (see the module
    docstring), in place; `model` is the whole model as one process builds it. With
    `sequence_parallel`, the residual stream, the norms and the biases after g hold this rank's
    1/tp of the tokens (Korthikanti et al. 2022, section 4.2.2); the whole parameters there then
    see only those tokens, so their gradients are summed over the ranks."""
    sp = sequence_parallel
    if any(isinstance(m, ColumnParallelLinear) for m in model.modules()):
        raise LmforgeError("tensor parallelism is already applied to this model")
    reason = tp_divisibility(model.cfg, comm.world)
    if reason:
        raise LmforgeError(reason)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _split_attention(module, comm, sp)
        elif isinstance(module, (SwiGLU, GeluMLP, ReLU2MLP)):
            _split_mlp(module, comm, sp)
    if sp:  # everything outside the regions: norms and the biases added after g
        outside = [p for block in model.blocks.values() for m in (block.attn_norm, block.mlp_norm, block.attn.o_proj,
                                                                block.mlp.down_proj) for p in m.parameters()]
        for param in [*outside, *model.norm.parameters()]:
            if sharded_dim(param) is None:
                _sum_gradient(param, comm)
        if model.pos_embeddings is not None:  # config/rules.py refuses it first
            raise LmforgeError("sequence parallelism with learned positions (model.family=gpt) is not written")
        model.rope = SequenceShardRope(model.rope, comm.world)
    if model.cfg.dropout > 0:  # the masks inside the regions drawn per rank (tp_rng.py)
        apply_tensor_rank_rng(model, comm.rank, sp)
    tied = model.cfg.tie_embeddings
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, comm, sp)
    cap = model.lm_head.cap if isinstance(model.lm_head, SoftcapHead) else None  # model.logit_softcap
    model.lm_head = ColumnParallelLinear(model.lm_head, comm, gather_output=True, cap=cap)
    if tied:
        model.lm_head.weight = model.tok_embeddings.weight  # the same rows of the same matrix
    model.lm_head.register_forward_pre_hook(_entering(comm, sp))
    vocab_start = model.lm_head.weight.shape[0] * comm.rank
    model.loss = VocabParallelHeadLoss(comm, vocab_start, sequence_parallel=sp, cap=cap)
    return model


def sharded_dim(param: torch.Tensor) -> int | None:
    """The dimension tensor parallelism splits `param` along; None where every rank holds it whole."""
    return getattr(param, "tp_dim", None)


def shard_copies(param: torch.Tensor) -> int:
    """How many tensor ranks hold the same slice of `param` (a replicated KV head's: tp / n_kv_heads)."""
    return getattr(param, "tp_copies", 1)

