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
from lmforge.modes.attention import BACKENDS
from lmforge.modes.recompute import get_recompute


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
    parts, mode = forward_flops_breakdown(cfg, seq_len), get_recompute(recompute)
    extra = 0.0
    if mode.blocks:
        down_projection = 2 * model_shapes(cfg).linear_weights["mlp.down_proj"]
        extra = sum(v for k, v in parts.items() if k != "lm_head") - down_projection
    elif mode.attention_cores:
        fused = lookup(BACKENDS, cfg.attention, "attention backend").fused
        extra = parts["attention_scores_qk"] + (parts["attention_values_av"] if fused else 0)
    return training_flops_per_token(cfg, seq_len) + extra


def six_n_flops_per_token(cfg: ModelConfig) -> float:
    """The 6N approximation (Kaplan et al. 2020, eq. 2.1), attention over the context ignored, with
    N the weights that multiply activations (shapes.Shapes.matmul_weights: the LM head in,
    embedding lookups, norm gains and biases out: they do no matmul work)."""
    return 6 * model_shapes(cfg).matmul_weights


def palm_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B): 6N plus the attention matmuls."""
    return six_n_flops_per_token(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
