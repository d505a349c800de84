"""Scaled dot-product attention behind one function, with interchangeable backends; and the rotary
position embeddings of its queries and keys (at the end of this file).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + mask) V        (Vaswani et al. 2017, eq. 1)

Shapes: q is (batch, heads, q_len, d_head); k and v are (batch, kv_heads, kv_len, d_head) with
`heads` a multiple of `kv_heads` (grouped-query attention, Ainslie et al. 2023: query head j reads
key/value head j // (heads / kv_heads)).

The causal mask is aligned to the *end* of the keys: query i sits at absolute position
kv_len - q_len + i and sees every key at or before it. With q_len == kv_len this is the usual
lower-triangular mask; with a KV cache (q_len < kv_len) the new queries see all cached keys.
A sliding window of w (Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023, section 2) narrows it to
a band: the query at position p sees the keys at p - w + 1 .. p, itself and the w - 1 before it
(transformers' sliding_window convention), so each layer reads w positions back and a stack of L
layers about L * w. Every backend implements it (naive and sdpa by the band mask, the flash
kernels by the same band in their tile masks, skipping tiles wholly outside it).

Backends:
  naive         materialises the (q_len x kv_len) score matrix and its softmax: the reference.
  sdpa          torch.nn.functional.scaled_dot_product_attention (fused kernels where available).
  flash_torch   FlashAttention-2 (Dao 2023) tile by tile in PyTorch: saves O(N) for backward,
                not the N x N probabilities (lmforge/kernels/flash_torch.py). No dropout.
  flash_triton  the same as Triton kernels, on CUDA, or on CPU under TRITON_INTERPRET=1 for
                tests (lmforge/kernels/flash_triton.py). Needs the optional triton. No dropout.
  auto          the backend measured fastest and checked on the tensors' device: sdpa (see
                `resolve_backend`).

Rotary position embeddings (Su et al. 2021, "RoFormer"): the frequencies (with Llama 3.1's
long-context scaling), the cos/sin tables and the rotation applied to queries and keys.
model/transformer.py's attention calls `apply_rope` with a `RotaryTables` module's slices.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum, repeat

from lmforge.common.errors import LmforgeError, lookup
from lmforge.config import ModelConfig
from lmforge.kernels import flash_triton
from lmforge.kernels.flash_torch import flash_attention_torch
from lmforge.modes import BACKENDS


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output of shape (batch, heads, q_len, d_head); see the module docstring.

    `mask`, if given, is a boolean (batch, 1, q_len, kv_len) of the keys each query may see, in place
    of `causal` and `window`: a padded batch's (`padded_mask`). The flash kernels take no per-row
    mask, so a masked call runs on sdpa (on naive where that is the backend); only inference makes one."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if mask is not None:
        if backend == "naive":
            return naive_attention(q, k, v, mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if backend == "auto":
        backend = resolve_backend(q.device, dropout_p=dropout_p)
    if not lookup(BACKENDS, backend, "attention backend").dropout and dropout_p > 0.0:
        # The flash kernels would have to regenerate the same dropout mask in backward from a saved
        # RNG state; they do not implement that.
        raise LmforgeError(f"attention backend {backend!r} does not support attention dropout "
                           f"(dropout_p={dropout_p}): set model.dropout=0 or use sdpa or naive")
    if window is not None and not causal:
        raise ValueError("a sliding window narrows the causal mask: it needs causal=True")
    if backend == "flash_torch":
        return flash_attention_torch(q, k, v, causal=causal, window=window)
    if backend == "flash_triton":
        return flash_triton.flash_attention_triton(q, k, v, causal=causal, window=window)
    if backend == "naive":
        return naive_attention(q, k, v, causal=causal, window=window, dropout_p=dropout_p)
    return sdpa_attention(q, k, v, causal=causal, window=window, dropout_p=dropout_p)


class AttentionCore(nn.Module):
    """`attention` as a module: a child of each attention layer that wrappers from outside
    (fp32 attention, selective recomputation) can wrap. Dropout applies only in training;
    `window` is the sliding window (None: every earlier position)."""

    def __init__(self, backend: str = "sdpa", dropout: float = 0.0, window: int | None = None):
        super().__init__()
        self.backend, self.dropout, self.window = backend, dropout, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        return attention(q, k, v, causal=True, window=self.window, backend=self.backend,
                         dropout_p=self.dropout if self.training else 0.0, mask=mask)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, dropout={self.dropout}" + (f", window={self.window}" if self.window else "")


def resolve_backend(device: torch.device, *, dropout_p: float = 0.0) -> str:
    """The backend `auto` stands for on `device`: sdpa, on CPU and on CUDA.

    CPU: in bench/RESULTS.md ("Attention backends") sdpa's fused C++ kernel was the fastest for
    forward+backward at every length from 128 to 4096 (flash_torch 1.04-1.98x its time, naive up
    to 4.2x), and it saves the same O(T) bytes as flash_torch. The Triton interpreter is for
    tests only.
    CUDA: sdpa as well. The Triton kernels have only run in Triton's CPU interpreter (whose bf16
    path upcasts tiles to fp32), never compiled for a GPU: their GPU block sizes, bf16 path and
    speed against sdpa's own FlashAttention-2 kernel are unchecked. Pick flash_triton by name to
    try them; `auto` can choose them once a GPU run of tests/test_flash.py and bench/attention.py
    backs it.
    """
    return "sdpa"


def causal_mask(q_len: int, kv_len: int, device=None, window: int | None = None) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask, True where a query may attend (end-aligned, see above); with
    a `window`, only the band of the window's last positions."""
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)
    return mask if window is None else mask.triu(diagonal=kv_len - q_len - window + 1)


def padded_mask(valid: torch.Tensor, q_len: int, window: int | None = None) -> torch.Tensor:
    """The (batch, 1, q_len, kv_len) mask of a padded batch. `valid` (batch, kv_len): which positions
    of each row hold a token (False: padding). A query sees the tokens at or before it (end-aligned,
    as `causal_mask`), padding never, and with a `window` only the tokens whose positions within
    the row, not counting padding, are less than `window` before its own. Each query also sees
    itself, so that a padding query's softmax is not empty (its output is never read)."""
    kv_len = valid.shape[1]
    positions = valid.long().cumsum(-1)
    mask = causal_mask(q_len, kv_len, device=valid.device) & valid[:, None, :]
    if window is not None:
        mask &= positions[:, None, :] > positions[:, -q_len:, None] - window
    mask |= causal_mask(q_len, kv_len, device=valid.device).triu(kv_len - q_len)  # the diagonal: itself
    return mask[:, None]


def naive_attention(q, k, v, *, causal=True, window=None, dropout_p=0.0, mask=None):
    group = q.shape[1] // k.shape[1]
    k = repeat(k, "b g t d -> b (g r) t d", r=group)
    v = repeat(v, "b g t d -> b (g r) t d", r=group)
    scores = einsum(q, k, "b h i d, b h j d -> b h i j") / math.sqrt(q.shape[-1])
    if causal and mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device, window=window)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax in at least fp32 whatever the input dtype: exp() of low-precision scores loses the tail.
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return einsum(probs, v, "b h i j, b h j d -> b h i d")


def sdpa_attention(q, k, v, *, causal=True, window=None, dropout_p=0.0):
    q_len, kv_len = q.shape[2], k.shape[2]
    attn_mask, is_causal = None, False
    if window is not None and kv_len > window:  # the window hides some keys: the band mask says which
        attn_mask = causal_mask(q_len, kv_len, device=q.device, window=window)
    elif causal and q_len == kv_len:
        is_causal = True  # lets SDPA pick a fused causal kernel
    elif causal and q_len > 1:
        attn_mask = causal_mask(q_len, kv_len, device=q.device)
    # (causal with a single query: it sees every key, no mask needed)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        enable_gqa=q.shape[1] != k.shape[1],
    )


# Rotary position embeddings (the module docstring's last paragraph)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequencies theta_i = theta^(-2(i-1)/d), i = 1..d/2 (Su et al. 2021, eq. 15), in float64.

    With `scaling` of rope_type llama3 (Llama 3.1, Dubey et al. 2024; Meta's released reference code),
    a model trained on `original_max_position_embeddings` positions reads contexts `factor` times
    longer: frequencies whose wavelength 2 pi / theta_i is shorter than original / high_freq_factor
    (they turn many times within the old context) are kept; those longer than original /
    low_freq_factor are divided by `factor`; in between, the two are blended linearly in
    original / wavelength, so the spectrum has no jump.
    """
    # on the CPU, whatever the default device: a few MB of float64 at most, and on the meta device (a
    # model built for its shapes) these ops would load torch._dynamo, seconds for nothing
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freqs
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
    scaled = (1 - blend) * freqs / factor + blend * freqs
    scaled = torch.where(wavelength < original / high, freqs, scaled)
    return torch.where(wavelength > original / low, freqs / factor, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles m * theta_i, each of shape (max_seq_len, head_dim).

    The angles are laid out as [angles, angles] for the rotate-half form below (the layout of
    GPT-NeoX and of Hugging Face Llama checkpoints), which pairs dimension j with dimension j + d/2.
    """
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_j, x_{j+d/2}) of x (batch, heads, seq, head_dim) by its angle (eq. 34)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class RotaryTables(nn.Module):
    """The cos/sin tables of rotary embeddings, computed once (fp32 buffers, not parameters: a
    precision policy that casts parameters leaves them alone). Every pipeline stage keeps one."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        device = torch.get_default_device()
        if device.type == "meta":  # a shapes-only build (accounting/shapes.py): no values to compute on the CPU
            cos = sin = torch.empty(cfg.max_seq_len, cfg.head_dim)
        else:
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, start_pos: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = slice(start_pos, start_pos + seq_len)
        return self.cos[window], self.sin[window]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at each row's own positions (batch, seq): (batch, 1, seq, head_dim), for a padded batch."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
