"""Matmul FLOPs of the lmforge transformer, counted from its shapes (read from the model: shapes.py).

A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs (one multiply and one add per term), so a
linear layer costs 2 FLOPs per weight per token: flops.py adds them up over the model's own linear
layers, and counts only the attention matmuls, which have no weights, by formula. Per token, in
the forward pass, that comes to (d model width, h query heads, g key/value heads, q head dim,
f MLP width, T sequence length, V vocabulary):
    QKV projections         2*d*(h*q) for Q, 2*d*(g*q) each for K and V
    output projection       2*(h*q)*d
    attention scores QK^T   2*T*(h*q)
    attention-weighted AV   2*T*(h*q)
    MLP                     2*d*f per matrix: 3 matrices for SwiGLU, 2 for the GELU MLP
    LM head                 2*d*V
Backward costs twice the forward (one matmul for the input gradient, one for the weight
gradient; Kaplan et al. 2020, section 2.1), so training costs 3x the forward.

Causal masking. By default attention is counted over the full T x T score matrix even though
causal masking leaves half of it unused, as PaLM's MFU does (Chowdhery et al. 2022, appendix B:
6N + 12*L*H*Q*T per token), so that MFU is comparable with published numbers. `causal=True`
halves the two attention matmuls instead: the work a kernel that skips masked blocks really
does (FlashAttention, Dao 2023). Elementwise work (norms, softmax, RoPE, activations) is not
counted: it is not matmul work and is small beside it.
"""

from lmforge.accounting.shapes import model_shapes
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes import BACKENDS, get_recompute


def forward_flops_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs per token, by component, summed over layers: 2 per weight of each
    linear layer, read from the model (shapes.py); the attention matmuls from their formula."""
    weights = model_shapes(cfg).components()
    attention = cfg.n_layers * 2 * seq_len * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)
    return {
        "qkv_projections": 2 * weights["qkv_projections"],
        "output_projection": 2 * weights["output_projection"],
        "attention_scores_qk": attention,
        "attention_values_av": attention,
        "mlp": 2 * weights["mlp"],
        "lm_head": 2 * weights["lm_head"],
    }


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    return sum(forward_flops_breakdown(cfg, seq_len, causal).values())


def training_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False,
                             lora: tuple[int, str] | None = None) -> float:
    """Forward + backward matmul FLOPs per trained token: the model FLOPs of MFU. `lora` = (rank,
    targets): adapters on a frozen base (model/lora.py), counted by lora_training_flops_per_token."""
    if lora is not None:
        return lora_training_flops_per_token(cfg, seq_len, *lora, causal=causal)
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def lora_training_flops_per_token(cfg: ModelConfig, seq_len: int, rank: int, targets: str,
                                  causal: bool = False) -> float:
    """Forward + backward matmul FLOPs per token of LoRA on a frozen base (model/lora.py).

    Forward: every linear layer, and per adapted one x A^T then (.) B^T, 2*r*(in + out). Backward
    runs only what autograd needs: a layer's input gradient (2 per weight, as the forward) where
    its input depends on something trainable, which the frozen embedding's output does not (so
    the first block's early layers skip theirs), and weight gradients only for the adapters
    (dB, and du = g B to reach A: 2*r*out each; dA: 2*r*in; dx through the adapter: 2*r*in where
    needed). The attention core's backward likewise computes dQ, dK, dP, dV only for what needs
    them. Checked against FlopCounterMode in tests/test_flops.py."""
    import torch.nn as nn

    from lmforge.model.lora import BASE, apply_lora, canonical, lora_layers
    from lmforge.model.transformer import meta_model

    model = apply_lora(meta_model(cfg), targets, rank)
    adapted = set(lora_layers(model))
    # the linear layers by canonical name (an adapted one under its own name, not its base's)
    linears = {canonical(name).removesuffix(f".{BASE}"): module.weight.shape for name, module in model.named_modules()
               if isinstance(module, nn.Linear)}
    attention = 2 * seq_len * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)  # QK^T or AV, per token
    total = 0.0

    def linear(name: str, input_needs_grad: bool) -> bool:
        """Add one linear layer's FLOPs; whether its output needs a gradient."""
        nonlocal total
        out_features, in_features = linears[name]
        total += 2 * in_features * out_features * (1 + input_needs_grad)
        if name in adapted:
            total += 2 * rank * (in_features + out_features) + 2 * rank * (2 * out_features + in_features)
            total += 2 * rank * in_features * input_needs_grad
        return input_needs_grad or name in adapted

    residual = False  # the frozen embedding's output needs no gradient
    for block in model.blocks:
        prefix = f"blocks.{block}."
        layers = [name for name in linears if name.startswith(prefix)]
        q, k, v = (linear(f"{prefix}attn.{n}", residual) for n in ("q_proj", "k_proj", "v_proj"))
        total += 2 * attention + attention * (q + k) + attention * ((q or k) + v)  # forward; dQ dK; dP dV
        residual = linear(f"{prefix}attn.o_proj", q or k or v) or residual
        hidden = any([linear(name, residual) for name in layers  # every MLP layer reading the normalised input
                      if name.startswith(f"{prefix}mlp.") and name != f"{prefix}mlp.down_proj"])
        residual = linear(f"{prefix}mlp.down_proj", hidden) or residual
    linear("lm_head", residual)
    return total


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                             lora: tuple[int, str] | None = None) -> float:
    """FLOPs the hardware executes per token, counting recomputation (the numerator of HFU,
    Chowdhery et al. 2022, appendix B). Full recomputation runs each block's forward twice, except
    its last matmul: torch.utils.checkpoint stops recomputing once every tensor backward needs is
    back, and the MLP's down projection output is needed by no one. Selective recomputation
    (Korthikanti et al. 2022, section 4.2) reruns the attention core: QK^T and AV where it is one
    fused op (sdpa, flash_*), QK^T alone with `naive`, whose AV output backward does not need.
    With `lora` the training FLOPs are LoRA's; the recomputed forward is still the base's alone."""
    parts, mode = forward_flops_breakdown(cfg, seq_len), get_recompute(recompute)
    extra = 0.0
    if mode.blocks:
        down_projection = 2 * model_shapes(cfg).linear_weights["mlp.down_proj"]
        extra = sum(v for k, v in parts.items() if k != "lm_head") - down_projection
    elif mode.attention_cores:
        fused = lookup(BACKENDS, cfg.attention, "attention backend").fused
        extra = parts["attention_scores_qk"] + (parts["attention_values_av"] if fused else 0)
    return training_flops_per_token(cfg, seq_len, lora=lora) + extra


def six_n_flops_per_token(cfg: ModelConfig) -> float:
    """The 6N approximation (Kaplan et al. 2020, eq. 2.1), attention over the context ignored, with
    N the weights that multiply activations (shapes.Shapes.matmul_weights: the LM head in,
    embedding lookups, norm gains and biases out: they do no matmul work)."""
    return 6 * model_shapes(cfg).matmul_weights


def palm_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B): 6N plus the attention matmuls."""
    return six_n_flops_per_token(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
