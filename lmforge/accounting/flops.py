"""Matmul FLOPs of the lmforge transformer, counted from its shapes.

A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs (one multiply and one add per term).
Per token, in the forward pass (d model width, h query heads, g key/value heads, q head dim,
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

from lmforge.config import ModelConfig


def forward_flops_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs per token, by component, summed over layers."""
    d, q, h, g, L = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads, cfg.n_layers
    attention_share = 0.5 if causal else 1.0
    return {
        "qkv_projections": L * 2 * d * q * (h + 2 * g),
        "output_projection": L * 2 * (h * q) * d,
        "attention_scores_qk": L * 2 * seq_len * h * q * attention_share,
        "attention_values_av": L * 2 * seq_len * h * q * attention_share,
        "mlp": L * 2 * d * cfg.ffn_dim * (3 if cfg.family == "llama" else 2),
        "lm_head": 2 * d * cfg.vocab_size,
    }


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    return sum(forward_flops_breakdown(cfg, seq_len, causal).values())


def training_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Forward + backward matmul FLOPs per trained token: the model FLOPs of MFU."""
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """FLOPs the hardware executes per token, counting recomputation (the numerator of HFU,
    Chowdhery et al. 2022, appendix B). Full recomputation runs each block's forward twice, except
    its last matmul: torch.utils.checkpoint stops recomputing once every tensor backward needs is
    back, and the MLP's down projection output is needed by no one. Selective recomputation
    (Korthikanti et al. 2022, section 4.2) reruns the attention core: QK^T and AV where it is one
    fused op (sdpa, flash_*), QK^T alone with `naive`, whose AV output backward does not need."""
    parts = forward_flops_breakdown(cfg, seq_len)
    extra = 0.0
    if recompute == "full":
        down_projection = cfg.n_layers * 2 * cfg.d_model * cfg.ffn_dim
        extra = sum(v for k, v in parts.items() if k != "lm_head") - down_projection
    elif recompute == "selective":
        extra = parts["attention_scores_qk"] + (parts["attention_values_av"] if cfg.attention != "naive" else 0)
    elif recompute != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}")
    return training_flops_per_token(cfg, seq_len) + extra


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights that multiply activations (projections, MLP, LM head): the N of 6N. Embedding
    lookups, norm gains and biases do no matmul work."""
    d, q = cfg.d_model, cfg.head_dim
    per_layer = d * q * (2 * cfg.n_heads + 2 * cfg.kv_heads) + d * cfg.ffn_dim * (3 if cfg.family == "llama" else 2)
    return cfg.n_layers * per_layer + d * cfg.vocab_size


def six_n_flops_per_token(cfg: ModelConfig) -> float:
    """The 6N approximation (Kaplan et al. 2020, eq. 2.1): attention over the context ignored."""
    return 6 * matmul_parameters(cfg)


def palm_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B): 6N plus the attention matmuls."""
    return six_n_flops_per_token(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
