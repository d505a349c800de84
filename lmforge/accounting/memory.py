"""Memory per device, in bytes, from the config and the model's shapes: model states, activations,
KV cache.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1): parameters, gradients and optimizer
states. In the paper's mixed-precision Adam a parameter costs 2 + 2 + K bytes (fp16 weight, fp16
gradient, K = 12 bytes of fp32 master weight, momentum and variance); ZeRO stage 1 shards the K
bytes over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 also the weights
(section 5.1-5.3). `zero_paper_model_state_bytes` is that formula; `model_state_bytes` is what
lmforge's own precision policies store (lmforge/precision/), each split the same way.

Activations: what autograd saves for backward. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4) count s*b*h*(34 + 5*a*s/h) bytes per
layer for GPT-3 in 16-bit with dropout; `korthikanti_activation_bytes` is that count with its
variants. `activation_breakdown` counts, tensor by tensor, what lmforge's model saves, in the
dtypes each precision policy gives those tensors (the family's own terms: activations.py; the
bytes per element: modes/precision.py); tests/test_memory.py checks it against the bytes
autograd really saves (accounting/measure.py).
"""

import math
from dataclasses import replace

from lmforge.accounting.activations import FAMILY_ACTIVATIONS
from lmforge.accounting.optimizers import OPTIMIZERS, optimizer_state_bytes
from lmforge.accounting.shapes import model_shapes, tensor_rank_model
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes.attention import BACKENDS
from lmforge.modes.precision import POLICIES, Policy
from lmforge.modes.recompute import get_recompute


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of lmforge's Transformer for cfg (tied embeddings counted once), read from the model."""
    return model_shapes(cfg).parameters


def sharded_layout(policy: Policy, zero_stage: int) -> Policy:
    """`policy` as the sharding engines run it: ZeRO stages 1-3 and FSDP (parallel/zero.py,
    fsdp.py) under a mixed policy compute on 16-bit working weights with fp32 master weights
    (Rajbhandari et al. 2020, section 3.1), so every parameter, the embedding's output and the
    residual stream are 16-bit, and autocast casts no weight for a matmul (an fp8 linear still
    quantises its own, from the gathered weight: whole, under stage 3 too). Measured against the
    engines in tests/test_memory_engines.py. Other policies and zero stage 0 are returned as they are."""
    if zero_stage == 0 or not policy.autocast:
        return policy
    p = policy.bytes
    return replace(policy, bytes=replace(p, parameter=p.compute, gradient=p.compute, master=4, residual=p.compute,
                                         weight_copy=p.weight_copy if policy.fp8 else 0, head_weight_copy=0))


# -- model states --------------------------------------------------------------------------------

def zero_paper_model_state_bytes(n_params: int, stage: int, dp: int, k: int = 12) -> float:
    """Rajbhandari et al. 2020, figure 1 and section 5: (2 + 2 + K) * Psi bytes on one device,
    with the K optimizer bytes (stage >= 1), the gradients (>= 2) and the weights (3) split N_d ways."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    weights, grads, optimizer = 2 * n_params, 2 * n_params, k * n_params
    return (weights / (dp if stage >= 3 else 1) + grads / (dp if stage >= 2 else 1)
            + optimizer / (dp if stage >= 1 else 1))


def lora_parameters(cfg: ModelConfig, rank: int, targets: str, tp: int = 1) -> int:
    """Trainable parameters of LoRA (model/lora.py): r * (in + out) per targeted linear layer, read
    from the meta-device model with the adapters applied. With tp > 1, those one tensor rank holds
    (parallel/tp_lora.py): a column-parallel layer's B is split by its output rows and its A whole,
    a row-parallel layer's A is split by its input columns and its B whole."""
    from lmforge.accounting.shapes import tensor_parallel_dim, tensor_parallel_slices
    from lmforge.model.meta import meta_model
    from lmforge.model.lora import apply_lora

    held = 0
    for name, param in apply_lora(meta_model(cfg), targets, rank).named_parameters():
        if not param.requires_grad:
            continue
        layer, adapter = name.rsplit(".", 1)
        split = {0: "lora_B", 1: "lora_A"}.get(tensor_parallel_dim(f"{layer}.weight"))
        # a replicated KV head's B is its head's rows (tp_lora.py): n_kv_heads slices, not tp
        held += param.numel() // (tensor_parallel_slices(f"{layer}.weight", cfg, tp) if adapter == split else 1)
    return held


def model_state_bytes(cfg: ModelConfig, policy: Policy = POLICIES["fp32"], optimizer: str = "adamw", zero_stage: int = 0,
                      dp: int = 1, tp: int = 1, lora_trainable: int | None = None,
                      parameter_shapes: tuple | None = None, fully_shard: bool = False,
                      hidden_matrices: int | None = None) -> dict[str, float]:
    """Bytes per device of parameters, gradients, master weights and optimizer states, as the
    engine of the strategy holds them (each engine's `state_bytes`; tests/test_composition_dist.py
    compares them in every cell it trains).

    `parameter_shapes`: the parameters this device holds, default the whole model; a pipeline
    stage's rank holds its own (accounting/pipeline.py's stage_parameters: a tensor rank's slices,
    as given, divided no further). Tensor parallelism (tp) splits the weights
    themselves: a tensor rank holds the shapes parallel/tp.py gives it (shapes.py's
    tensor_rank_shapes: the split matrices divided by tp (k and v by their KV heads where tp
    is a multiple of them: replicated KV heads), norm gains and row-parallel biases
    whole), so do its gradients and optimizer states. `lora_trainable`: the adapter parameters one device holds (lora_parameters with tp). ZeRO's and FSDP's padding to a multiple of dp is not counted
    (none where each unit or dimension divides evenly). `hidden_matrices`: a stage's Muon elements.

    `fully_shard` (train.parallel=fsdp, zero_stage 3): FSDP2 shards the parameters as the policy
    stores them (fp32 under the mixed policies: they are the master weights) and keeps sharded
    gradients in that dtype too; its 16-bit copies exist only while a block is gathered. ZeRO's
    engines keep 16-bit working parameters and gradients and fp32 master shards (sharded_layout).

    With LoRA (`lora_trainable` adapter parameters) the base is frozen: it is stored in the
    policy's parameter dtype and has no gradient, master copy or optimizer state; ZeRO keeps it
    whole on every rank at every stage (parallel/zero.py), FSDP shards it. The adapters are fp32
    (train/setup.py creates them after the policy), with fp32 moments; ZeRO computes with them in
    its working dtype (16-bit copies and gradients, the fp32 adapters as master shards) where that
    is not fp32, the other engines in fp32.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    if fully_shard and zero_stage != 3:
        raise ValueError(f"fully_shard shards parameters: zero stage 3, got {zero_stage}")
    p = policy.bytes
    layout = (policy if fully_shard else sharded_layout(policy, zero_stage)).bytes
    even = tp if parameter_shapes is None else 1  # what is left to divide evenly
    if tp > 1 and parameter_shapes is None:  # a tensor rank's own shapes: its norm gains whole
        shapes = model_shapes(cfg)
        parameter_shapes, even = shapes.tensor_rank_shapes(tp), 1
        if lookup(OPTIMIZERS, optimizer, "optimizer").hidden_matrix_states is not None:  # Muon: its slices
            hidden_matrices = shapes.tensor_rank_block_matmul_weights(tp, cfg.kv_heads)
    held = parameter_count(cfg) if parameter_shapes is None else sum(math.prod(shape) for shape in parameter_shapes)
    n = held / even
    if lora_trainable is None:
        frozen, trained = 0, n
        parameter, gradient, master = layout.parameter, layout.gradient, layout.master
        optimizer_bytes = optimizer_state_bytes(cfg, optimizer, policy, parameter_shapes, hidden_matrices) / even
    else:
        frozen, trained = n * p.parameter, lora_trainable
        zero = zero_stage > 0 and not fully_shard
        parameter = layout.parameter if zero else 4  # the working adapters: ZeRO's dtype, else fp32
        gradient, master = parameter, 4 if parameter != 4 else 0
        optimizer_bytes = trained * lookup(OPTIMIZERS, optimizer, "optimizer").states * 4
    frozen_split = dp if fully_shard else 1  # ZeRO keeps the frozen base whole
    return {
        "parameters": frozen / frozen_split + trained * parameter / (dp if zero_stage >= 3 else 1),
        "gradients": trained * gradient / (dp if zero_stage >= 2 else 1),
        "master_weights": trained * master / (dp if zero_stage >= 1 else 1),
        "optimizer_states": optimizer_bytes / (dp if zero_stage >= 1 else 1),
    }


# -- activations ---------------------------------------------------------------------------------

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

    With `loss_chunk_tokens` (wrap/chunked_loss.py) the head and loss keep their finished
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
    if tp > 1:  # the vocabulary-parallel head and loss (parallel/tp_loss.py) instead
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
    """What the final norm, the vocabulary-parallel LM head and its loss (parallel/tp_loss.py) save
    on one of tp ranks: the norm and the head's input on this rank's tokens (sequence parallelism:
    tp_ops.linear_on_gathered keeps the shard) or all of them; of the fp32 logits of its V/tp
    vocabulary, the shifted ones (the target's gather keeps them) and their exponentials; the int64
    target index, which targets are its own and which are counted (bool), the fp32 sum of
    exponentials (for its log) and the int64 count of targets."""
    bs = b * s
    split = tp if sequence_parallel else 1
    return ((final_norm + bs * cfg.d_model * head_input) / split + 2 * bs * (cfg.vocab_size // tp) * 4
            + bs * (8 + 1 + 1 + 4) + 8)


def logits_bytes(cfg: ModelConfig, b: int, s: int, policy: Policy = POLICIES["fp32"],
                 loss_chunk_tokens: int = 0) -> float:
    """The LM head's logits and their fp32 copy for the loss: alive at the end of the forward
    pass beside everything saved; for small models with large vocabularies the largest tensor.
    The chunked loss holds those of one chunk of `loss_chunk_tokens` tokens at a time."""
    p = policy.bytes
    tokens = min(loss_chunk_tokens, b * s) if loss_chunk_tokens else b * s
    return tokens * cfg.vocab_size * (p.compute + (4 if p.compute < 4 else 0))


def kv_cache_bytes(cfg: ModelConfig, b: int, s: int, dtype_bytes: int = 2) -> int:
    """Inference KV cache: keys and values for every layer and kv head, 2*b*s*L*g*d_head*bytes."""
    return 2 * b * s * cfg.n_layers * cfg.kv_heads * cfg.head_dim * dtype_bytes
