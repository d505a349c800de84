"""Memory per device, in bytes, from the config alone: model states, activations, KV cache.

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
dtypes each precision policy gives those tensors; tests/test_memory.py checks it against the
bytes autograd really saves (accounting/measure.py).
"""

from dataclasses import dataclass

from lmforge.config import ModelConfig

OPTIMIZER_STATES = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}  # fp32-sized state tensors per parameter
ATTENTION_KINDS = ("naive", "sdpa", "flash_torch", "flash_triton")  # naive keeps the s x s scores


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor a precision policy (lmforge/precision/) stores."""
    parameter: int  # the parameters the model holds
    gradient: int
    master: int  # a separate fp32 master copy of the weights (0: the parameters are the master)
    optimizer_state: int  # each optimizer state element (AdamW has two per parameter)
    compute: int  # matmul outputs and the attention tensors
    linear_input: int  # what a block's linear layer keeps of its input for the weight gradient
    weight_copy: int  # a cast of each block linear weight made in forward, kept for backward (0: none)
    head_weight_copy: int  # the same for the LM head's weight
    autocast: bool  # low precision by torch.autocast around fp32 parameters and residual stream
    fp8_scales: int = 0  # bytes of per-tensor scales each block linear keeps (fp8: input and weight)

    @property
    def residual(self) -> int:
        """The residual stream: fp32 around autocast (the embedding output is fp32), else the
        parameters' dtype."""
        return 4 if self.autocast else self.parameter


PRECISION_BYTES: dict[str, PrecisionBytes] = {
    "fp32": PrecisionBytes(4, 4, 0, 4, compute=4, linear_input=4, weight_copy=0, head_weight_copy=0,
                           autocast=False),
    # torch.autocast keeps fp32 parameters (they are the master weights, Micikevicius et al. 2018)
    # and casts each weight and each linear input to 16 bits per use; the casts live until backward.
    "bf16-mixed": PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                 autocast=True),
    "fp16-mixed": PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                 autocast=True),
    # Everything in bfloat16, optimizer states included: half the model-state bytes of fp32.
    "bf16-pure": PrecisionBytes(2, 2, 0, 2, compute=2, linear_input=2, weight_copy=0, head_weight_copy=0,
                                autocast=False),
    # bf16-mixed, but each block linear keeps its weight and its input as 1-byte e4m3 with two fp32
    # scales (Micikevicius et al. 2022); the LM head stays in bf16 (precision/policy.py says why).
    "fp8": PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=1, weight_copy=1, head_weight_copy=2,
                          autocast=True, fp8_scales=8),
}
PRECISION_ALIASES = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}


def policy_name(precision: str) -> str:
    """The policy a precision name stands for (aliases resolved); ValueError if unknown."""
    name = PRECISION_ALIASES.get(precision, precision)
    if name not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join([*PRECISION_BYTES, *PRECISION_ALIASES])}")
    return name


def precision_bytes(precision: str) -> PrecisionBytes:
    return PRECISION_BYTES[policy_name(precision)]


# -- parameters ----------------------------------------------------------------------------------

def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of lmforge's Transformer for cfg (tied embeddings counted once)."""
    d, q, f, L, V = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    attention = d * q * (2 * cfg.n_heads + 2 * cfg.kv_heads)
    if cfg.family == "llama":
        per_layer = attention + 3 * d * f + 2 * d  # q,k,v,o; gate, up, down; two RMSNorm gains
        return L * per_layer + V * d * (1 if cfg.tie_embeddings else 2) + d
    biases = q * (cfg.n_heads + 2 * cfg.kv_heads) + d + f + d  # q, k, v; o; up; down
    per_layer = attention + 2 * d * f + biases + 2 * 2 * d  # two LayerNorms with gain and bias
    return L * per_layer + V * d * (1 if cfg.tie_embeddings else 2) + cfg.max_seq_len * d + 2 * d


def matmul_weight_count(cfg: ModelConfig) -> int:
    """Weights of the linear layers (what autocast and fp8 cast per step), LM head included."""
    d, q = cfg.d_model, cfg.head_dim
    mlp = d * cfg.ffn_dim * (3 if cfg.family == "llama" else 2)
    return cfg.n_layers * (d * q * (2 * cfg.n_heads + 2 * cfg.kv_heads) + mlp) + d * cfg.vocab_size


# -- model states --------------------------------------------------------------------------------

def zero_paper_model_state_bytes(n_params: int, stage: int, dp: int, k: int = 12) -> float:
    """Rajbhandari et al. 2020, figure 1 and section 5: (2 + 2 + K) * Psi bytes on one device,
    with the K optimizer bytes (stage >= 1), the gradients (>= 2) and the weights (3) split N_d ways."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    weights, grads, optimizer = 2 * n_params, 2 * n_params, k * n_params
    return (weights / (dp if stage >= 3 else 1) + grads / (dp if stage >= 2 else 1)
            + optimizer / (dp if stage >= 1 else 1))


def model_state_bytes(cfg: ModelConfig, precision: str = "fp32", optimizer: str = "adamw", zero_stage: int = 0,
                      dp: int = 1, tp: int = 1, pp: int = 1) -> dict[str, float]:
    """Bytes per device of parameters, gradients, master weights and optimizer states.

    Tensor (tp) and pipeline (pp) parallelism split the weights themselves, so every term is
    divided by tp*pp (an even split: embeddings and norms are assumed spread like the rest).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    p = precision_bytes(precision)
    n = parameter_count(cfg) / (tp * pp)
    return {
        "parameters": n * p.parameter / (dp if zero_stage >= 3 else 1),
        "gradients": n * p.gradient / (dp if zero_stage >= 2 else 1),
        "master_weights": n * p.master / (dp if zero_stage >= 1 else 1),
        "optimizer_states": n * OPTIMIZER_STATES[optimizer] * p.optimizer_state / (dp if zero_stage >= 1 else 1),
    }


# -- activations ---------------------------------------------------------------------------------

def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, layers: int, recompute: str = "none",
                                 tp: int = 1, sequence_parallel: bool = True, flash: bool = False) -> float:
    """Activation bytes for a GPT-3-style model in 16-bit (Korthikanti et al. 2022, section 4).

    Per layer: s*b*h*(34 + 5*a*s/h) (eq. 1); with tensor parallelism t and sequence parallelism
    s*b*h*(34/t + 5*a*s/(h*t)) (eq. 5), without sequence parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t))
    (eq. 4); selective recomputation drops the 5*a*s/h term of the attention core (section 4.2:
    34*s*b*h/t), as FlashAttention does by never storing the s x s matrices; full recomputation
    keeps only each layer's input, 2*s*b*h (section 4.1). Pipeline parallelism does not change the
    first stage's total (L/p layers, p micro-batches in flight, section 4.2.3).
    """
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / (tp if sequence_parallel else 1)
    else:
        attention_core = 0 if (recompute == "selective" or flash) else 5 * a * s / h
        if recompute not in ("none", "selective"):
            raise ValueError(f"unknown recompute mode {recompute!r}")
        if sequence_parallel:
            per_layer = sbh * (34 / tp + attention_core / tp)
        else:
            per_layer = sbh * (10 + 24 / tp + attention_core / tp)
    return layers * per_layer


def attention_saved_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, element_bytes: int,
                          attention: str = "sdpa", recompute: str = "none") -> int:
    """Bytes one attention core (q, k, v -> output; model/attention.py) saves for backward, for
    b sequences of s tokens with q, k, v of `element_bytes` per element."""
    bsq, bskv = b * s * heads * head_dim, b * s * kv_heads * head_dim
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {attention!r}; known: {', '.join(ATTENTION_KINDS)}")
    if recompute == "selective":  # rerun in backward from its inputs, which are all it keeps
        return (bsq + 2 * bskv) * element_bytes
    if attention == "naive":
        # q, and k and v repeated to every query head; the causal mask; the fp32 softmax output
        # and (below fp32) its cast back: the 5*a*s/h term of Korthikanti et al.
        probs = b * heads * s * s * (4 + (element_bytes if element_bytes < 4 else 0))
        return 3 * bsq * element_bytes + probs + s * s
    # Fused kernels keep q, k, v, the output and one fp32 log-sum-exp per row (Dao 2023,
    # algorithm 1, line 12): no s x s term.
    return (2 * bsq + 2 * bskv) * element_bytes + b * heads * s * 4


def layer_activation_breakdown(cfg: ModelConfig, b: int, s: int, precision: str = "fp32",
                               attention: str = "sdpa", recompute: str = "none",
                               fp32_attention: bool = False) -> dict[str, int]:
    """Bytes one transformer block saves for backward, by part, counted tensor by tensor from
    model/transformer.py (and checked against autograd in tests/test_memory.py). fp32_attention:
    the attention core runs on fp32 copies of q, k, v (train.fp32_attention)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {recompute!r}")
    p = precision_bytes(precision)
    d, f = cfg.d_model, cfg.ffn_dim
    bsd, bs, bsq = b * s * d, b * s, b * s * cfg.n_heads * cfg.head_dim
    if recompute == "full":  # torch.utils.checkpoint keeps only the block's input
        return {"block_input": bsd * p.residual}
    if cfg.family == "llama":
        # RMSNorm runs in fp32 (F.rms_norm decomposes under autograd): the input, 1/rms per row
        # and the normalised x (for the gain's gradient); a gain stored below fp32 is cast up
        # with the input, and the cast is kept too.
        norms = 2 * (2 * bsd * 4 + bs * 4 + (d * 4 if p.parameter < 4 else 0))
        # SwiGLU: gate and up outputs and silu(gate); their product is the down projection's input
        mlp = 3 * b * s * f * p.compute + b * s * f * p.linear_input
        readers = 5  # q, k, v, gate and up read a normalised input
    else:
        # LayerNorm, in the residual stream's dtype: the input, mean and 1/std per row; GELU
        # keeps its input.
        norms = 2 * (bsd + 2 * bs) * p.residual
        mlp = b * s * f * p.compute + b * s * f * p.linear_input
        readers = 4  # q, k, v and up
    # Without autocast a normalised input is one tensor shared by its readers; autocast casts it
    # once per linear layer, and each cast is kept.
    linear_inputs = (readers if p.autocast else 2) * bsd * p.linear_input
    linears = readers + 2  # and the output and down projections
    linear_inputs += linears * p.fp8_scales
    # fp32 attention below fp32 casts q, k, v up and the output back down: the core keeps fp32
    # tensors (unless recomputed: then it keeps its inputs, cast inside), the output is a new tensor.
    widened = fp32_attention and p.compute < 4
    core_bytes = 4 if widened and recompute != "selective" else p.compute
    # The output projection reads the attention output. A fused kernel's output is already laid
    # out (b, s, h*d) and is the tensor the kernel keeps; naive attention's output is copied out
    # of (b, h, s, d); a recomputed core keeps no output of its own.
    shares_kernel_output = (attention != "naive" and recompute == "none" and p.linear_input == p.compute
                            and not widened)
    out_proj_input = 0 if shares_kernel_output else bsq * p.linear_input
    return {
        "norms": norms,
        "linear_inputs": linear_inputs + out_proj_input,
        "attention": attention_saved_bytes(b, s, cfg.n_heads, cfg.kv_heads, cfg.head_dim, core_bytes, attention,
                                           recompute),
        "mlp": mlp,
    }


def activation_breakdown(cfg: ModelConfig, b: int, s: int, precision: str = "fp32", attention: str = "sdpa",
                         recompute: str = "none", tp: int = 1, pp: int = 1,
                         fp32_attention: bool = False) -> dict[str, float]:
    """Bytes saved for backward over one micro-batch of b sequences of s tokens, per device.

    Layers: tensor parallelism with sequence parallelism divides each layer's activations by tp
    (Korthikanti et al. 2022, eq. 5); a 1F1B pipeline's first stage holds L/pp layers for pp
    micro-batches in flight, the same total as no pipeline (section 4.2.3).
    """
    p = precision_bytes(precision)
    layer = layer_activation_breakdown(cfg, b, s, precision, attention, recompute, fp32_attention)
    layers = cfg.n_layers * sum(layer.values()) / tp
    bs, bsd = b * s, b * s * cfg.d_model
    if cfg.family == "llama":  # RMSNorm in fp32: input, normalised x, 1/rms per row (and the gain's cast)
        head_norm = 2 * bsd * 4 + bs * 4 + (cfg.d_model * 4 if p.parameter < 4 else 0)
    else:  # LayerNorm: input, mean, 1/std
        head_norm = (bsd + 2 * bs) * p.residual
    head_input = p.compute if p.autocast else p.linear_input  # the LM head is never fp8
    block_weights = matmul_weight_count(cfg) - cfg.d_model * cfg.vocab_size
    result = {
        "layers": layers,
        # the token ids the embedding gathers (int64), and the position ids of learned positions
        "embedding": bs * 8 + (s * 8 if cfg.family == "gpt" else 0),
        # final norm, the LM head's input, the fp32 log-probabilities and the int64 targets
        "head_and_loss": head_norm + bsd * head_input + bs * cfg.vocab_size * 4 + bs * 8,
        # RoPE's cos and sin tables, kept once for all layers (not inside recomputed blocks)
        "rope_tables": 2 * cfg.max_seq_len * cfg.head_dim * 4 if cfg.family == "llama" and recompute != "full" else 0,
        # the per-use weight casts; inside fully recomputed blocks they are recast in backward
        "weight_copies": ((0 if recompute == "full" else block_weights * p.weight_copy)
                          + cfg.d_model * cfg.vocab_size * p.head_weight_copy) / (tp * pp),
    }
    if recompute == "full":  # backward reruns one block at a time: its activations come back
        recomputed = layer_activation_breakdown(cfg, b, s, precision, attention, fp32_attention=fp32_attention)
        result["recomputed_layer"] = sum(recomputed.values()) / tp
    return result


def logits_bytes(cfg: ModelConfig, b: int, s: int, precision: str = "fp32") -> float:
    """The LM head's logits and their fp32 copy for the loss: alive at the end of the forward
    pass beside everything saved; for small models with large vocabularies the largest tensor."""
    p = precision_bytes(precision)
    return b * s * cfg.vocab_size * (p.compute + (4 if p.compute < 4 else 0))


def kv_cache_bytes(cfg: ModelConfig, b: int, s: int, dtype_bytes: int = 2) -> int:
    """Inference KV cache: keys and values for every layer and kv head, 2*b*s*L*g*d_head*bytes."""
    return 2 * b * s * cfg.n_layers * cfg.kv_heads * cfg.head_dim * dtype_bytes
