"""FlashAttention-2 as Triton kernels: the `flash_triton` attention backend.

Same algorithm and conventions as lmforge.kernels.flash_torch (read that first: it is the same
thing with the loops in Python); the kernels live in flash_triton_kernels.py. Triton is optional
(`pip install 'lmforge[triton]'`) and imported only when this backend runs, so lmforge imports
without it. The kernels run on a CUDA GPU, or on CPU tensors in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was first imported (slow: for tests, not for speed).

Saved for backward, as in flash_torch: q, k, v, out (input dtype) and the fp32 log-sum-exp
(batch, heads, q_len). The kernels index q, k, v as dense arrays, so non-contiguous inputs (the
model's q and k are (batch, seq, heads, d) memory seen as (batch, heads, seq, d)) are copied
first, and the copies are what is saved: the same bytes, plus a transient copy in forward. The
rowsum D = rowsum(dO * O) of Algorithm 2, line 4, is one elementwise PyTorch op here rather than a
separate kernel.
"""

import importlib.util
import math
import os

import torch

from lmforge.common.errors import LmforgeError
from lmforge.kernels.flash_torch import check_flash_inputs

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
# Software-pipelining depth (Triton's num_stages: tiles loaded ahead while the current ones are
# multiplied) per kernel, from bench/flash_sweep.py on an H200 (bench/RESULTS.md, 2026-11-30):
# at 64x64 blocks, 4 warps, bf16, b4 h16 s4096 d128 causal the dK/dV kernel ran 1.42 ms with one
# stage against 2.21 ms with Triton's default three, dQ 0.99 ms with two against 1.25 ms; the
# forward is fastest at the default. Other GPUs may prefer others (rerun the sweep there); the
# interpreter ignores the setting.
NUM_STAGES = {"forward": 3, "dkdv": 1, "dq": 2}


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device) -> str | None:
    """Why flash_triton cannot run on `device`, or None if it can."""
    if not triton_installed():
        return ("attention backend 'flash_triton' needs triton: pip install 'lmforge[triton]' "
                "(or pick model.attention=flash_torch, sdpa or naive)")
    if device.type == "cuda" and not interpreting():
        return None
    if device.type == "cpu" and interpreting():
        return None
    return (f"attention backend 'flash_triton' runs on a CUDA GPU, or on CPU only in Triton's "
            f"interpreter (set TRITON_INTERPRET=1 before starting; slow, for testing); got "
            f"{device.type} tensors" + (" with TRITON_INTERPRET=1" if interpreting() else "")
            + ": pick model.attention=flash_torch or sdpa instead")


def _kernels():
    from lmforge.kernels import flash_triton_kernels  # imports triton: only once we know it is there

    return flash_triton_kernels


def _head_block(d_head: int) -> int:
    """Tile width over the head dimension: a power of two (tl.arange needs one), at least 16 (tl.dot)."""
    return max(16, 1 << (d_head - 1).bit_length())


def _check_block(name: str, size: int) -> None:
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernels, got {size}")


def flash_attention_triton(q, k, v, *, causal=True, window=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Attention output (batch, heads, q_len, d_head) from the Triton kernels; differentiable.
    `window`: a sliding window (flash_torch.py); None passes one wider than any band."""
    reason = unavailable_reason(q.device)
    if reason:
        raise LmforgeError(reason)
    check_flash_inputs(q, k, v, causal=causal, block_q=block_q, block_k=block_k, window=window)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    return FlashAttentionTriton.apply(q, k, v, causal, block_q, block_k, window or q.shape[2] + k.shape[2])


def _launch_settings(q, causal, block_q, block_k):
    d_head = q.shape[-1]
    return dict(CAUSAL=causal, UPCAST_TILES=interpreting() and q.dtype != torch.float32,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                BLOCK_M=block_q, BLOCK_N=block_k, BLOCK_D=_head_block(d_head))


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k, window):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, q_len, d_head = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        # (batch, heads, q_len, d_head) view of (batch, q_len, heads, d_head) memory, as sdpa returns.
        out = torch.empty(batch, q_len, heads, d_head, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
        grid = (triton_cdiv(q_len, block_q), batch * heads)
        _kernels().flash_forward_kernel[grid](
            q, k, v, out, lse, 1.0 / math.sqrt(d_head), heads, kv_heads, q_len, kv_len, d_head, window,
            **_launch_settings(q, causal, block_q, block_k), num_stages=NUM_STAGES["forward"])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k, ctx.window = causal, block_q, block_k, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        batch, heads, q_len, d_head = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # Algorithm 2, line 4
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        settings = _launch_settings(q, ctx.causal, ctx.block_q, ctx.block_k)
        shape_args = (1.0 / math.sqrt(d_head), heads, kv_heads, q_len, kv_len, d_head, ctx.window)
        kernels = _kernels()
        kernels.flash_backward_dkdv_kernel[(triton_cdiv(kv_len, ctx.block_k), batch * kv_heads)](
            q, k, v, grad_out, lse, delta, grad_k, grad_v, *shape_args, **settings, num_stages=NUM_STAGES["dkdv"])
        kernels.flash_backward_dq_kernel[(triton_cdiv(q_len, ctx.block_q), batch * heads)](
            q, k, v, grad_out, lse, delta, grad_q, *shape_args, **settings, num_stages=NUM_STAGES["dq"])
        return grad_q, grad_k, grad_v, None, None, None, None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
