"""Matmul FLOPs of the lmforge transformer, counted from its shapes.

A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs (one multiply and one add per term).
Per token, in the forward pass:
    attention projections   2*d*(h*q) for Q and for O, 2*d*(g*q) for K and for V
                            (h query heads, g key/value heads, q head dim)
    attention scores QK^T   2*T*(h*q)      and the weighted sum AV: 2*T*(h*q)
    MLP                     2*d*f per matrix: 3 matrices for SwiGLU, 2 for GELU
    LM head                 2*d*V
Backward costs twice the forward (one matmul for the input gradient, one for the weight
gradient), so training costs 3x the forward.

Attention is counted over the full T x T score matrix even when causal masking makes half of it
unused, as PaLM's MFU does (Chowdhery et al. 2022, appendix B: 6N + 12*L*H*Q*T per token); the
figure is then comparable with published MFU numbers. Elementwise work (norms, softmax, RoPE,
activations) is not counted: it is not matmul work and is small beside it.
"""

from lmforge.config import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    d, q = cfg.d_model, cfg.head_dim
    projections = 2 * d * q * (2 * cfg.n_heads + 2 * cfg.kv_heads)
    attention_scores = 2 * 2 * seq_len * cfg.n_heads * q
    mlp = 2 * d * cfg.ffn_dim * (3 if cfg.family == "llama" else 2)
    lm_head = 2 * d * cfg.vocab_size
    return cfg.n_layers * (projections + attention_scores + mlp) + lm_head


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward matmul FLOPs per trained token (the model FLOPs of MFU)."""
    return 3 * forward_flops_per_token(cfg, seq_len)
