"""The attention backends by name (implemented in attention.py), and what accounting needs to
know of each.

Kept apart from attention.py, which loads torch, so that config validation and `lmforge --help`
can name them without importing torch (seconds on a busy machine).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str
    # One fused op computes softmax(Q K^T) V and keeps q, k, v, the output and an fp32
    # log-sum-exp per row for backward (Dao 2023): O(s) bytes, and a selective recomputation
    # reruns QK^T and AV both. False: the s x s probabilities are materialised and kept.
    fused: bool
    dropout: bool  # implements attention dropout
    description: str


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("naive", fused=False, dropout=True, description="materialises the s x s scores: the reference"),
    Backend("sdpa", fused=True, dropout=True, description="torch's scaled_dot_product_attention"),
    Backend("flash_torch", fused=True, dropout=False, description="FlashAttention-2 tile by tile in PyTorch"),
    Backend("flash_triton", fused=True, dropout=False, description="FlashAttention-2 as Triton kernels"),
    # every backend attention.resolve_backend picks for `auto` is fused and has dropout (today: sdpa)
    Backend("auto", fused=True, dropout=True, description="chosen per device at run time (sdpa)"),
)}
# The flash kernels would have to regenerate the dropout mask in backward; they do not.
FLASH_BACKENDS = tuple(name for name, backend in BACKENDS.items() if not backend.dropout)
