"""Activations: what autograd saves for backward, in bytes, per device.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
4) count s*b*h*(34 + 5*a*s/h) bytes per layer for GPT-3 in 16-bit with dropout;
`korthikanti_activation_bytes` is that count with its variants. `activation_breakdown` counts,
tensor by tensor, what lmforge's model saves, in the dtypes each precision policy gives those
tensors (the bytes per element: modes/): first each model family's own modules
(`FAMILY_ACTIVATIONS`), then the terms every family shares (linear-layer inputs, the attention
core, weight casts, head and loss). tests/test_memory.py checks it to the byte against the bytes
autograd really saves (accounting/measure.py).

The formulas stay analytic, tensor by tensor, because they are the point: they say why a layer
keeps what it keeps. The family table has the keys and order of model/transformer.FAMILIES (a test
checks that they agree). They live here and not beside those modules in model/transformer.py
because they are made of what the model must not know: the bytes of a precision policy and what
a recomputation mode keeps.
"""

from dataclasses import dataclass

from lmforge.accounting.shapes import model_shapes, tensor_rank_model
from lmforge.common.errors import lookup
from lmforge.config import ModelConfig
from lmforge.modes import BACKENDS, POLICIES, Policy, get_recompute


@dataclass(frozen=True)
class FamilyActivations:
    """Bytes a family's own modules save for b sequences of s tokens."""
    block_norms: int  # the two norms of one block
    mlp: int  # one block's MLP: its hidden activations and the down projection's input
    norm_readers: int  # linear layers of a block that read a normalised input (each keeps it, or its cast)
    final_norm: int  # the norm before the LM head
    position_ids: int  # what the embedding keeps to add positions
    position_tables: int  # tables every block reads, kept once (not inside fully recomputed blocks)
    qk_norms: int = 0  # one block's QK-norm (model.qk_norm), on its heads: tensor ranks split it


# One block's MLP by model.mlp (model/transformer.py, model/recipe.py), for bsf = b*s*ffn_dim hidden
# values: (bytes it saves, its linear layers that read the normalised input).
MLP_ACTIVATIONS = {
    # gate and up outputs and silu(gate); their product is the down projection's input
    "swiglu": lambda bsf, p: (3 * bsf * p.compute + bsf * p.linear_input, 2),
    # GELU keeps its input; its output is down's input
    "gelu": lambda bsf, p: (bsf * p.compute + bsf * p.linear_input, 1),
    # ReLU keeps its output, which square() keeps too (one tensor); the square is down's input
    "relu2": lambda bsf, p: (bsf * p.compute + bsf * p.linear_input, 1),
}


def llama_activations(cfg: ModelConfig, b: int, s: int, policy: Policy) -> FamilyActivations:
    """RMSNorm, the MLP of model.mlp (SwiGLU by default) and RotaryTables (model/attention.py); biases
    (model.qkv_bias) keep nothing."""
    p, bsd, bs = policy.bytes, b * s * cfg.d_model, b * s
    mlp_bytes, mlp_readers = MLP_ACTIVATIONS[cfg.mlp_kind](b * s * cfg.ffn_dim, p)
    # RMSNorm runs in fp32 (F.rms_norm decomposes under autograd): the input, 1/rms per row and
    # the normalised x (for the gain's gradient); a gain stored below fp32 is cast up with the
    # input, and the cast is kept too.
    rms_norm = 2 * bsd * 4 + bs * 4 + (cfg.d_model * 4 if p.parameter < 4 else 0)
    # QK-norm (model.qk_norm): the same three tensors for each head's query and key, one per head and row
    heads = cfg.n_heads + cfg.kv_heads
    qk_norms = 2 * bs * heads * cfg.head_dim * 4 + bs * heads * 4 + (2 * cfg.head_dim * 4 if p.parameter < 4 else 0)
    return FamilyActivations(
        block_norms=2 * rms_norm,
        qk_norms=qk_norms if cfg.qk_norm else 0,
        mlp=mlp_bytes,
        norm_readers=3 + mlp_readers,  # q, k, v and the MLP's input projections
        final_norm=rms_norm,
        position_ids=0,  # rotary: positions enter through the tables
        position_tables=2 * cfg.max_seq_len * cfg.head_dim * 4,  # fp32 cos and sin
    )


def gpt_activations(cfg: ModelConfig, b: int, s: int, policy: Policy) -> FamilyActivations:
    """LayerNorm, the MLP of model.mlp (GeluMLP by default) and learned positions (model/transformer.py);
    biases keep nothing."""
    p, bsd, bs = policy.bytes, b * s * cfg.d_model, b * s
    mlp_bytes, mlp_readers = MLP_ACTIVATIONS[cfg.mlp_kind](b * s * cfg.ffn_dim, p)
    # LayerNorm, in the residual stream's dtype: the input, mean and 1/std per row
    layer_norm = (bsd + 2 * bs) * p.residual
    return FamilyActivations(
        block_norms=2 * layer_norm,
        mlp=mlp_bytes,
        norm_readers=3 + mlp_readers,  # q, k, v and the MLP's input projections
        final_norm=layer_norm,
        position_ids=s * 8,  # the int64 positions the position table gathers
        position_tables=0,
    )


FAMILY_ACTIVATIONS = {"llama": llama_activations, "gpt": gpt_activations}


# -- the count every family shares ---------------------------------------------------------------------------------

def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, layers: int, recompute: str = "none",
                                 tp: int = 1, sequence_parallel: bool = True, flash: bool = False) -> float:
    """Activation bytes for a GPT-3-style model in 16-bit (Korthikanti et al. 2022, section 4).

    Per layer: s*b*h*(34 + 5*a*s/h) (eq. 1); with tensor parallelism t and sequence parallelism
    s*b*h*(34/t + 5*a*s/(h*t)) (eq. 5), without sequence parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t))
    (eq. 4); selective recomputation drops the 5*a*s/h term of the attention core (section 4.2:
    34*s*b*h/t), as FlashAttention does by never storing the s x s matrices; full recomputation
    keeps only each layer's input, 2*s*b*h (section 4.1), whole on every tensor rank (table 2's
    last row). With sequence parallelism that input is itself split along the sequence (section
    4.2.2: outside the tensor-parallel regions each rank holds s/t of it), so 2*s*b*h/t: a row
    table 2 does not have. Pipeline parallelism does not change the first stage's total (L/p
    layers, p micro-batches in flight, section 4.2.3). Table 2's six rows are checked in
    tests/test_plan_tensor_parallel.py.
    """
    sbh, mode = s * b * h, get_recompute(recompute)
    if mode.blocks:
        per_layer = 2 * sbh / (tp if sequence_parallel else 1)
    else:
        attention_core = 0 if (mode.attention_cores or flash) else 5 * a * s / h
        if sequence_parallel:
            per_layer = sbh * (34 / tp + attention_core / tp)
        else:
            per_layer = sbh * (10 + 24 / tp + attention_core / tp)
    return layers * per_layer


def attention_saved_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, element_bytes: int,
                          attention: str = "sdpa", recompute: str = "none", window: int | None = None) -> int:
    """Bytes one attention core (q, k, v -> output; model/attention.py) saves for backward, for
    b sequences of s tokens with q, k, v of `element_bytes` per element."""
    bsq, bskv = b * s * heads * head_dim, b * s * kv_heads * head_dim
    backend = lookup(BACKENDS, attention, "attention backend")
    if get_recompute(recompute).attention_cores:  # rerun in backward from its inputs, which are all it keeps
        return (bsq + 2 * bskv) * element_bytes
    if not backend.fused:
        # q, and k and v repeated to every query head; the causal mask; the fp32 softmax output
        # and (below fp32) its cast back: the 5*a*s/h term of Korthikanti et al.
        probs = b * heads * s * s * (4 + (element_bytes if element_bytes < 4 else 0))
        return 3 * bsq * element_bytes + probs + s * s
    # Fused kernels keep q, k, v, the output and one fp32 log-sum-exp per row (Dao 2023,
    # algorithm 1, line 12): no s x s term, but for sdpa's sliding-window band (model.sliding_window
    # below s), which it takes as an s x s additive mask in the inputs' dtype and keeps.
    band = s * s * element_bytes if window is not None and window < s and attention in ("sdpa", "auto") else 0
    return (2 * bsq + 2 * bskv) * element_bytes + b * heads * s * 4 + band


def layer_activation_breakdown(cfg: ModelConfig, b: int, s: int, policy: Policy = POLICIES["fp32"],
                               attention: str = "sdpa", recompute: str = "none",
                               fp32_attention: bool = False) -> dict[str, int]:
    """Bytes one transformer block saves for backward, by part, counted tensor by tensor from
    model/transformer.py (and checked against autograd in tests/test_memory.py); the family's own
    terms come from activations.py. fp32_attention: the attention core runs on fp32 copies of q,
    k, v (train.fp32_attention)."""
    mode = get_recompute(recompute)
    p = policy.bytes
    bsd, bsq = b * s * cfg.d_model, b * s * cfg.n_heads * cfg.head_dim
    if mode.blocks:  # torch.utils.checkpoint keeps only the block's input
        return {"block_input": bsd * p.residual}
    family = FAMILY_ACTIVATIONS[cfg.family](cfg, b, s, policy)
    # A normalised input (in the residual stream's dtype) already in the linear layers' input
    # dtype is one tensor shared by its readers; in another, each reader casts it (autocast, fp8
    # quantisation) and keeps its cast. These are the layer's full-width inputs to column-parallel
    # layers: without sequence parallelism every tensor rank holds all of them.
    norm_outputs = (family.norm_readers if p.linear_input != p.residual else 2) * bsd * p.linear_input
    linears = family.norm_readers + 2  # and the output and down projections
    # fp32 attention below fp32 casts q, k, v up and the output back down: the core keeps fp32
    # tensors (unless recomputed: then it keeps its inputs, cast inside), the output is a new tensor.
    widened = fp32_attention and p.compute < 4
    core_bytes = 4 if widened and not mode.attention_cores else p.compute
    # The output projection reads the attention output. A fused kernel's output is already laid
    # out (b, s, h*d) and is the tensor the kernel keeps; naive attention's output is copied out
    # of (b, h, s, d); a recomputed core keeps no output of its own.
    shares_kernel_output = (lookup(BACKENDS, attention, "attention backend").fused and not mode.attention_cores
                            and p.linear_input == p.compute and not widened)
    out_proj_input = 0 if shares_kernel_output else bsq * p.linear_input
    return {
        "norms": family.block_norms,
        "qk_norms": family.qk_norms,  # on each rank's own heads under tensor parallelism, as attention
        "norm_outputs": norm_outputs,
        "linear_inputs": linears * p.fp8_scales + out_proj_input,
        "attention": attention_saved_bytes(b, s, cfg.n_heads, cfg.kv_heads, cfg.head_dim, core_bytes, attention,
                                           recompute, cfg.sliding_window),
        "mlp": family.mlp,
    }


# What tensor parallelism without sequence parallelism leaves whole on every tensor rank: the
# norms and the full-width inputs of the column-parallel layers (Korthikanti et al. 2022, section
# 4.2.2: the 10*s*b*h of eq. 4), and a fully recomputed block's input (2*s*b*h, section 4.1).
REPLICATED_WITHOUT_SP = ("norms", "norm_outputs", "block_input")


def split_over_tensor_ranks(layer: dict[str, int], tp: int, sequence_parallel: bool) -> float:
    """One layer's saved bytes on one of tp tensor ranks: everything split tp ways with sequence
    parallelism (eq. 5); without it, the parts in REPLICATED_WITHOUT_SP whole (eq. 4)."""
    whole = 0 if sequence_parallel else sum(v for k, v in layer.items() if k in REPLICATED_WITHOUT_SP)
    return whole + (sum(layer.values()) - whole) / tp


def activation_breakdown(cfg: ModelConfig, b: int, s: int, policy: Policy = POLICIES["fp32"], attention: str = "sdpa",
                         recompute: str = "none", tp: int = 1, fp32_attention: bool = False,
                         loss_chunk_tokens: int = 0, sequence_parallel: bool = True, *, layers: int | None = None,
                         first: bool = True, last: bool = True) -> dict[str, float]:
    """Bytes saved for backward over one micro-batch of b sequences of s tokens, per device.

    With `loss_chunk_tokens` (wrap.py) the head and loss keep their finished
    gradients instead: dh in the residual stream's dtype and dW in fp32, no logits, no head cast.

    Layers: tensor parallelism with sequence parallelism divides each layer's activations by tp
    (Korthikanti et al. 2022, eq. 5), without it the norms and column-parallel inputs stay whole
    (eq. 4). A pipeline stage (accounting/pipeline.py) holds `layers` blocks, the embedding's
    terms only if it is the `first` stage and the head's and loss's only if it is the `last`;
    the rotary tables on every stage (each keeps its own). The default is the whole model.
    Under ZeRO or FSDP, `policy` is the engine's (sharded_layout): no weight casts under autocast.
    """
    # a replicated KV head's k and v, and their weights' casts (parallel/tp.py): each rank keeps its copy's
    per_rank = tensor_rank_model(cfg, tp)
    mode, shapes = get_recompute(recompute), model_shapes(per_rank)
    p = policy.bytes
    layers = cfg.n_layers if layers is None else layers
    family = FAMILY_ACTIVATIONS[cfg.family](cfg, b, s, policy)
    gathering = tp > 1 and sequence_parallel  # the column-parallel linears keep their input's shard
    layer = layer_activation_breakdown(per_rank, b, s, policy, attention, recompute, fp32_attention)
    bs, bsd = b * s, b * s * cfg.d_model
    head_input = p.compute if policy.autocast else p.linear_input  # the LM head is never fp8
    head_weights = shapes.linear_weights["lm_head"]
    block_weights = shapes.block_matmul_weights // cfg.n_layers * layers  # every block has the same weights
    if gathering:  # tp_ops.linear_on_gathered: the shard in the residual dtype, its weight cast again in backward
        layer, head_input, head_weights = kept_shards(layer, bsd, p.residual), p.residual, 0
        row_parallel = shapes.linear_weights["attn.o_proj"] + shapes.linear_weights["mlp.down_proj"]
        block_weights = row_parallel // cfg.n_layers * layers  # only F.linear's casts are kept
    if tp > 1:  # the vocabulary-parallel head and loss (parallel/tp_ops.py) instead
        head_and_loss = (vocab_parallel_head_and_loss(cfg, family.final_norm, b, s, head_input, tp, sequence_parallel)
                         # a soft-capped head: tanh keeps its output, this rank's V/tp logits of every token
                         + (bs * (cfg.vocab_size // tp) * p.compute if cfg.logit_softcap else 0))
    else:  # final norm, the LM head's input, the fp32 log-probabilities and the int64 targets
        head_and_loss = family.final_norm + (
            bsd * p.residual + head_weights * 4 if loss_chunk_tokens
            else bsd * head_input + bs * cfg.vocab_size * 4 + bs * 8
            # a soft-capped head (model.logit_softcap, model/recipe.py): tanh keeps its output
            + (bs * cfg.vocab_size * p.compute if cfg.logit_softcap else 0))
    result = {
        "layers": layers * split_over_tensor_ranks(layer, tp, sequence_parallel),
        # the token ids the embedding gathers (int64), and what it keeps to add positions; a
        # vocabulary-parallel embedding also keeps which tokens are outside its rows (bool)
        "embedding": bs * 8 + family.position_ids + (bs if tp > 1 else 0) if first else 0,
        "head_and_loss": head_and_loss if last else 0,
        # tables every block reads (RoPE's cos and sin), kept once; not inside fully recomputed blocks
        "rope_tables": 0 if mode.blocks else family.position_tables,
        # the per-use weight casts; inside fully recomputed blocks they are recast in backward
        "weight_copies": ((0 if mode.blocks else block_weights * p.weight_copy)
                          + (0 if loss_chunk_tokens or not last else head_weights * p.head_weight_copy)) / tp,
    }
    if mode.blocks:  # backward reruns one block at a time: its activations come back
        recomputed = layer_activation_breakdown(per_rank, b, s, policy, attention, fp32_attention=fp32_attention)
        result["recomputed_layer"] = split_over_tensor_ranks(
            kept_shards(recomputed, bsd, p.residual) if gathering else recomputed, tp, sequence_parallel)
    return result


def kept_shards(layer: dict[str, int], bsd: int, residual: int) -> dict[str, int]:
    """A layer under sequence parallelism: each region's column-parallel linears keep one tensor,
    the normalised input in the residual dtype (tp_ops.linear_on_gathered casts it again in
    backward), whatever their readers' dtype; split tp ways by split_over_tensor_ranks."""
    return {**layer, "norm_outputs": 2 * bsd * residual} if "norm_outputs" in layer else layer


def vocab_parallel_head_and_loss(cfg: ModelConfig, final_norm: int, b: int, s: int, head_input: int, tp: int,
                                 sequence_parallel: bool) -> float:
    """What the final norm, the vocabulary-parallel LM head and its loss (parallel/tp_ops.py) save
    on one of tp ranks: the norm and the head's input on this rank's tokens (sequence parallelism:
    tp_ops.linear_on_gathered keeps the shard) or all of them; of the fp32 logits of its V/tp
    vocabulary, the shifted ones (the target's gather keeps them) and their exponentials; the int64
    target index, which targets are its own and which are counted (bool), the fp32 sum of
    exponentials (for its log) and the int64 count of targets."""
    bs = b * s
    split = tp if sequence_parallel else 1
    return ((final_norm + bs * cfg.d_model * head_input) / split + 2 * bs * (cfg.vocab_size // tp) * 4
            + bs * (8 + 1 + 1 + 4) + 8)
