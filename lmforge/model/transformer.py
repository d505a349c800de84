"""A decoder-only transformer in two families, chosen by `ModelConfig.family`.

llama (default), after Touvron et al. 2023 (LLaMA, section 2.2):
    pre-normalisation with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings
    (Su et al. 2021), SwiGLU feed-forward (Shazeer 2020), no biases, and grouped-query
    attention (Ainslie et al. 2023).
    Build-time choices (ModelConfig) add what Qwen2 (q, k, v biases), Qwen3 (QK-norm, its own
    head width) and Mistral (sliding-window attention) change in it: see `Attention`.
gpt, after Radford et al. 2019 (GPT-2, section 2.3) and Brown et al. 2020 (GPT-3):
    pre-normalisation with LayerNorm, learned absolute positions, a GELU MLP of width 4d,
    biases everywhere, dropout.

The family picks its parts once, when the model is built (`FAMILIES` below, as litgpt's config
does); no forward pass asks which family it is in. Every block computes (pre-norm residual form)
    h = x + Attention(Norm(x))
    y = h + MLP(Norm(h))
and the model is the composition of four pieces,
    x = embed(tokens);   x = blocks(x);   logits = head(x) = Norm(x) @ W_head;   loss(logits, targets)
The loss is a child module (`HeadLoss`: it holds no weights, it is handed the norm and the head)
so that a version that never materialises the logits (wrap.py) or a compiled one
can replace it from outside.
A pipeline stage is the same model with pieces removed (torchtitan's convention): set
`tok_embeddings`, `norm` or `lm_head` to None, or delete blocks, and forward skips what is missing.
Blocks live in a ModuleDict keyed by layer index, so a stage holding layers 8-15 names their
parameters exactly as the whole model does (`blocks.8.attn.q_proj.weight`).
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.overrides import TorchFunctionMode

from lmforge.config import ModelConfig
from lmforge.model.attention import AttentionCore, RotaryTables, apply_rope, padded_mask
from lmforge.model.init import init_weights
from lmforge.model.recipe import ReLU2MLP, SoftcapHead


class RMSNorm(nn.Module):
    """RMSNorm, computed in at least fp32 (the mean of squares in low precision loses small
    components): y = x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019, eq. 4; no mean subtraction).
    The forward calls PyTorch's fused kernel for it: one pass over memory instead of five, 13% faster
    per call on CPU; test_model checks it against the formula."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(wide), self.weight.shape, self.weight.to(wide), self.eps).to(x.dtype)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention. `bias` puts biases on all four projections (gpt);
    the llama family's choices come from the config: `qkv_bias` on the query, key and value ones
    (Qwen2), `qk_norm` an RMSNorm over each head's query and key before they are rotated (Qwen3;
    Henry et al. 2020, Dehghani et al. 2023: it bounds the attention logits), and
    `sliding_window` in the attention core (Mistral). An absent choice builds nothing or an
    nn.Identity, so the forward is the same for every architecture."""

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        qkv_bias = bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        # softmax(Q K^T / sqrt(d)) V as a child module: wrappers (fp32 attention, selective
        # recomputation) wrap it from outside, visibly in print(model).
        self.core = AttentionCore(cfg.attention, cfg.dropout, cfg.sliding_window)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=bias)

    def forward(self, x, rope=None, cache=None, start_pos=0, mask=None):
        # QK-norm (where built) normalises each head's d_head features before the transpose, so q and k
        # keep the (b, t, h, d) memory that sdpa's kernels read, and its output is laid out alike
        q = self.q_norm(rearrange(self.q_proj(x), "b t (h d) -> b t h d", h=self.n_heads)).transpose(1, 2)
        k = self.k_norm(rearrange(self.k_proj(x), "b t (h d) -> b t h d", h=self.n_kv_heads)).transpose(1, 2)
        v = rearrange(self.v_proj(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        if rope is not None:  # rotary families rotate queries and keys by position
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # keys and values of earlier positions, plus these
            k, v = cache.update(k, v, start_pos)
        # only a padded batch has a mask; the core's training wrappers (fp32, recompute, ring) never see one
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """FFN_SwiGLU(x) = (Swish(x W_gate) * x W_up) W_down   (Shazeer 2020, eq. 6)."""
    ACTIVATION_INPUT = "gate_proj"  # the layer feeding the nonlinearity (model/init.py's kaiming gain)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """FFN(x) = GELU(x W_up + b_up) W_down + b_down, width 4d (GPT-2 uses the tanh approximation)."""
    ACTIVATION_INPUT = "up_proj"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP, "relu2": ReLU2MLP}  # model.mlp; unset: the family's own


@dataclass(frozen=True)
class Family:
    """What distinguishes a family, decided once at build time."""
    norm: Callable[[ModelConfig], nn.Module]
    mlp: Callable[[ModelConfig], nn.Module]
    bias: bool  # biases in the attention projections (the MLP classes carry their own)
    rotary: bool  # rotary embeddings in attention (Su et al. 2021) ...
    learned_positions: bool  # ... or a learned position table added to the token embeddings


FAMILIES = {
    "llama": Family(norm=lambda cfg: RMSNorm(cfg.d_model, cfg.norm_eps), mlp=SwiGLU, bias=False,
                    rotary=True, learned_positions=False),
    "gpt": Family(norm=lambda cfg: nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), mlp=GeluMLP, bias=True,
                  rotary=False, learned_positions=True),
}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        family = FAMILIES[cfg.family]
        self.attn_norm = family.norm(cfg)
        self.attn = Attention(cfg, bias=family.bias)
        self.mlp_norm = family.norm(cfg)
        self.mlp = MLPS[cfg.mlp](cfg) if cfg.mlp else family.mlp(cfg)
        self.residual_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None, cache=None, start_pos=0, mask=None):
        x = x + self.residual_dropout(self.attn(self.attn_norm(x), rope, cache, start_pos, mask))
        return x + self.residual_dropout(self.mlp(self.mlp_norm(x)))


def padded_positions(valid: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The positions (batch, seq_len) of the last seq_len of `valid`'s: tokens before each in its row."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]


IGNORE_INDEX = -100  # a target the loss leaves out (a prompt token, padding: data/sft.py)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets that are not IGNORE_INDEX, in fp32 whatever the
    compute dtype: log-softmax over a large vocabulary is where low precision hurts most."""
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                           targets.flatten(), ignore_index=IGNORE_INDEX)


class HeadLoss(nn.Module):
    """The last piece of a training forward: the final norm, the LM head and the mean cross-entropy
    of its logits. Parameter-free, so that replacing it (wrap.py) renames nothing."""

    def forward(self, x: torch.Tensor, norm: nn.Module, lm_head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(lm_head(norm(x)), targets)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        family = FAMILIES[cfg.family]
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if family.learned_positions else None
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.rope = RotaryTables(cfg) if family.rotary else None
        self.blocks = nn.ModuleDict({str(layer): Block(cfg) for layer in range(cfg.n_layers)})
        self.norm = family.norm(cfg)
        self.lm_head = (SoftcapHead(cfg.d_model, cfg.vocab_size, cfg.logit_softcap) if cfg.logit_softcap
                        else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))
        self.loss = HeadLoss()
        if cfg.tie_embeddings:  # Press & Wolf 2017: one matrix embeds tokens and scores them
            self.lm_head.weight = self.tok_embeddings.weight
        init_weights(self, cfg)

    # -- the pieces, in the order a token goes through them ------------------------------------------

    def embed(self, tokens: torch.Tensor, start_pos: int = 0, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (plus learned positions where the family has them): (batch, seq, d)."""
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(start_pos, start_pos + tokens.shape[1], device=tokens.device)
                                        if valid is None else padded_positions(valid, tokens.shape[1]))
        return self.embed_dropout(x)

    def run_blocks(self, x: torch.Tensor, kv_cache=None, start_pos: int = 0,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
        """Every block this model holds, in layer order; `kv_cache` holds past keys and values;
        `valid`, a padded batch's (see `forward`)."""
        mask = None
        if valid is None:
            rope = self.rope(start_pos, x.shape[1]) if self.rope is not None else None
        else:
            mask = padded_mask(valid, x.shape[1], self.cfg.sliding_window)
            rope = self.rope.at(padded_positions(valid, x.shape[1])) if self.rope is not None else None
        for layer, block in self.blocks.items():
            cache = kv_cache.layer(int(layer)) if kv_cache is not None else None
            x = block(x, rope, cache, start_pos, mask)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the LM head: logits (batch, seq, vocab)."""
        return self.lm_head(self.norm(x))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache=None, start_pos: int = 0, valid: torch.Tensor | None = None,
                last: int | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for `tokens`; with `targets`, the mean cross-entropy instead;
        with `last`, the logits of the last `last` positions only (a prompt's next token, a scored
        continuation: the head over a whole context would be wasted, 1 GB of fp32 logits at 2,000
        positions of a 128k vocabulary).

        With a `kv_cache`, `tokens` continue a sequence whose first `start_pos` positions are cached.
        `valid`, for a batch of rows padded where they differ in length (batched decoding and
        scoring): a boolean (batch, start_pos + seq) saying which positions of each row, cached and
        new, hold tokens (as transformers' attention_mask). Padding is never attended to and not
        counted: a token's position (rotary angle, learned position) is the number of tokens before
        it in its row. Without it every position holds a token; right padding needs none (a causal
        model's earlier positions never see later ones).
        A model cut into a pipeline stage takes hidden states instead of tokens where it has no
        embedding, and returns them where it has no head.
        """
        seq_len = tokens.shape[1]
        if start_pos + seq_len > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {start_pos + seq_len} exceed max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(tokens, start_pos, valid) if self.tok_embeddings is not None else tokens
        x = self.run_blocks(x, kv_cache, start_pos, valid)
        if self.lm_head is None:
            return x
        if targets is not None:
            return self.loss(x, self.norm, self.lm_head, targets)
        return self.head(x if last is None else x[:, -last:])

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (shared tensors once); embeddings=False leaves out the token and
        position tables, as the 'non-embedding' N of Kaplan et al. 2020 does."""
        total = sum(p.numel() for p in self.parameters())
        if not embeddings:
            for table in (self.tok_embeddings, self.pos_embeddings):
                total -= table.weight.numel() if table is not None else 0
        return total


# The model without initialisation: its shapes for the accounting (accounting/shapes.py), a module
# tree for setup on the meta device (train/setup.py), storage for weights about to be assigned
# (runs/load.py, interop/).
_RANDOM_FILLS = {torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
                 torch.Tensor.normal_, torch.Tensor.uniform_}


class _SkipRandomFills(TorchFunctionMode):
    """Meta tensors (all this builds) hold no values, so random initialisation has nothing to
    do; and the meta kernel of normal_ is a Python reference that imports torch._dynamo on
    first use: 2-3 s on a busy 2-core machine, 30x the build itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig, device: str = "meta") -> Transformer:
    """lmforge's Transformer for `cfg` without initialisation: on the meta device shapes and no
    storage; on a real device uninitialised storage, for weights to be assigned (runs/load.py)."""
    with torch.device(device), _SkipRandomFills():
        return Transformer(cfg)
