"""FlashAttention backends: same numbers as a float64 reference, O(N) saved memory, same training.

The Triton kernels run on a GPU when there is one, else in Triton's CPU interpreter. `@triton.jit`
reads TRITON_INTERPRET when the kernels module is imported, so it is set here, before anything
imports lmforge.kernels.flash_triton_kernels (lmforge itself imports it only when the backend runs).
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmforge.accounting.activations import attention_saved_bytes  # noqa: E402
from lmforge.accounting.measure import measure_saved_bytes  # noqa: E402
from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.kernels import flash_triton  # noqa: E402
from lmforge.kernels.flash_torch import flash_attention_torch  # noqa: E402
from lmforge.model import attention as attention_module  # noqa: E402
from lmforge.model.attention import attention, naive_attention, resolve_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(flash_triton.unavailable_reason(DEVICE) is not None,
                                  reason=flash_triton.unavailable_reason(DEVICE) or "")

# (heads, kv_heads, q_len, kv_len, causal): odd lengths that no block size divides, grouped-query
# attention, and a KV-cache-like q_len < kv_len with the end-aligned causal mask.
CASES = [
    (2, 2, 37, 37, True),
    (4, 2, 37, 37, False),
    (4, 1, 5, 41, True),
    (2, 2, 33, 19, False),
    (3, 3, 1, 23, True),
]
# Compared with the float64 reference: fp32 rounds at ~1e-7 relative; bf16 inputs and outputs
# carry 8 mantissa bits (~4e-3 relative), and gradients add the rounding of several bf16 products.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def random_qkv(heads, kv_heads, q_len, kv_len, d_head=16, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, d_head, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, kv_len, d_head, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, kv_len, d_head, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(batch, heads, q_len, d_head, generator=generator, dtype=torch.float64)
    return q, k, v, grad_out


def output_and_grads(fn, q, k, v, grad_out, dtype):
    """fn(q, k, v) and dq, dk, dv for upstream gradient grad_out, with inputs cast to dtype."""
    inputs = [t.detach().to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(DEVICE, dtype))
    return [t.double().cpu() for t in (out, *grads)]


def assert_matches_reference(fn, case, dtype, d_head=16):
    heads, kv_heads, q_len, kv_len, causal = case
    q, k, v, grad_out = random_qkv(heads, kv_heads, q_len, kv_len, d_head)
    expected = output_and_grads(functools.partial(naive_attention, causal=causal), q, k, v, grad_out,
                                torch.float64)
    actual = output_and_grads(fn, q, k, v, grad_out, dtype)
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}g{}-q{}k{}-{}".format(*c[:4], "causal" if c[4] else "full"))
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash_torch", "auto"])
def test_backend_matches_float64_reference(backend, case, dtype):
    assert_matches_reference(functools.partial(attention, causal=case[4], backend=backend), case, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}g{}-q{}k{}-{}".format(*c[:4], "causal" if c[4] else "full"))
def test_flash_triton_matches_float64_reference(case, dtype):
    fn = functools.partial(flash_triton.flash_attention_triton, causal=case[4], block_q=16, block_k=16)
    assert_matches_reference(fn, case, dtype)


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (7, 5), (16, 64), (128, 128)])
def test_flash_torch_is_independent_of_block_sizes(block_q, block_k):
    fn = functools.partial(flash_attention_torch, causal=True, block_q=block_q, block_k=block_k)
    assert_matches_reference(fn, (4, 2, 29, 35, True), torch.float32)


@needs_triton
@pytest.mark.parametrize("block_q, block_k", [(16, 32), (32, 16)])
def test_flash_triton_is_independent_of_block_sizes(block_q, block_k):
    fn = functools.partial(flash_triton.flash_attention_triton, causal=True, block_q=block_q, block_k=block_k)
    assert_matches_reference(fn, (4, 2, 29, 35, True), torch.float32)


@pytest.mark.parametrize("d_head", [8, 24, 64])
def test_flash_torch_handles_head_dimensions(d_head):
    fn = functools.partial(flash_attention_torch, causal=True, block_q=16, block_k=16)
    assert_matches_reference(fn, (2, 1, 21, 21, True), torch.float32, d_head=d_head)


@needs_triton
@pytest.mark.parametrize("d_head", [8, 24, 64])
def test_flash_triton_pads_head_dimensions(d_head):
    fn = functools.partial(flash_triton.flash_attention_triton, causal=True, block_q=16, block_k=16)
    assert_matches_reference(fn, (2, 1, 21, 21, True), torch.float32, d_head=d_head)


def test_flash_torch_keeps_bf16_outputs_in_bf16():
    q, k, v, _ = random_qkv(2, 2, 9, 9)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = flash_attention_torch(q, k, v)
    out.sum().backward()
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["flash_torch", pytest.param("flash_triton", marks=needs_triton)])
def test_flash_output_is_laid_out_like_sdpa(backend):
    # (batch, heads, T, d) as a view of (batch, T, heads, d) memory: the model's rearrange to
    # (batch, T, heads * d) is then free, and the output projection saves this storage, not a copy.
    q, k, v, _ = random_qkv(4, 2, 20, 20)
    out = attention(q.float(), k.float(), v.float(), backend=backend)
    assert out.transpose(1, 2).is_contiguous()


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["flash_torch", "flash_triton"])
def test_flash_backends_refuse_dropout(backend):
    q, k, v, _ = random_qkv(2, 2, 8, 8)
    with pytest.raises(LmforgeError, match=f"{backend}' does not support attention dropout"):
        attention(q.float(), k.float(), v.float(), backend=backend, dropout_p=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(q_len=9, kv_len=5, causal=True), "causal attention needs q_len <= kv_len"),
    (dict(q_len=8, kv_len=8, causal=True, block_q=0), "block sizes must be positive"),
])
def test_flash_torch_rejects_bad_shapes(kwargs, message):
    q, k, v, _ = random_qkv(2, 2, kwargs.pop("q_len"), kwargs.pop("kv_len"))
    with pytest.raises(ValueError, match=message):
        flash_attention_torch(q, k, v, **kwargs)


def test_flash_torch_rejects_mismatched_inputs():
    q, k, v, _ = random_qkv(3, 3, 8, 8)
    with pytest.raises(ValueError, match="must be a multiple of kv heads"):
        flash_attention_torch(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="share one dtype"):
        flash_attention_torch(q, k.float(), v)
    with pytest.raises(ValueError, match="same shape"):
        flash_attention_torch(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="4-d"):
        flash_attention_torch(q[0], k[0], v[0])


@needs_triton
def test_flash_triton_rejects_block_sizes_it_cannot_tile():
    q, k, v, _ = random_qkv(2, 2, 8, 8)
    with pytest.raises(ValueError, match="power of two >= 16"):
        flash_triton.flash_attention_triton(q.float(), k.float(), v.float(), block_q=24)


def test_flash_triton_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(flash_triton, "triton_installed", lambda: False)
    q, k, v, _ = random_qkv(2, 2, 8, 8)
    with pytest.raises(LmforgeError, match=r"needs triton: pip install 'lmforge\[triton\]'"):
        attention(q, k, v, backend="flash_triton")


def test_flash_triton_on_cpu_without_the_interpreter_says_how(monkeypatch):
    monkeypatch.setattr(flash_triton, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = random_qkv(2, 2, 8, 8)
    with pytest.raises(LmforgeError, match="CUDA GPU, or on CPU only in Triton's interpreter"):
        attention(q, k, v, backend="flash_triton")


def test_auto_picks_sdpa_on_cpu_and_on_cuda_until_the_triton_kernels_have_run_on_a_gpu(monkeypatch):
    monkeypatch.setattr(flash_triton, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for device in ("cpu", "cuda"):
        assert resolve_backend(torch.device(device)) == "sdpa"
        assert resolve_backend(torch.device(device), dropout_p=0.1) == "sdpa"


# ---- memory: what autograd keeps for backward -------------------------------------------------------

def saved_bytes(backend, seq_len, batch=1, heads=4, kv_heads=2, d_head=16):
    q, k, v, _ = random_qkv(heads, kv_heads, seq_len, seq_len, d_head, batch)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    with measure_saved_bytes() as saved:
        if backend == "flash_triton":
            flash_triton.flash_attention_triton(q, k, v, causal=True)
        else:
            attention(q, k, v, causal=True, backend=backend)
    return saved.activations


def attention_saved_bytes_formula(seq_len, backend="flash_torch", batch=1, heads=4, kv_heads=2, d_head=16):
    """The count accounting/memory.py uses for the model: Q and O (batch, heads, T, d) and K, V
    (batch, kv_heads, T, d) in the input dtype plus the fp32 log-sum-exp for the flash kernels."""
    return attention_saved_bytes(batch, seq_len, heads, kv_heads, d_head, 4, backend)


LENGTHS = [64, 128, 256, 512]


def test_naive_saves_quadratic_and_flash_linear_memory():
    naive = [saved_bytes("naive", t) for t in LENGTHS]
    flash = [saved_bytes("flash_torch", t) for t in LENGTHS]
    assert flash == [attention_saved_bytes_formula(t) for t in LENGTHS]
    assert naive == [attention_saved_bytes_formula(t, "naive") for t in LENGTHS]
    # Doubling T doubles flash's bytes and nearly quadruples naive's (its T x T scores and
    # probabilities dominate; the linear Q, K, V part makes the ratio a little under 4).
    assert all(b == 2 * a for a, b in zip(flash, flash[1:]))
    naive_growth = [b / a for a, b in zip(naive, naive[1:])]
    assert all(growth > 3.0 for growth in naive_growth) and naive_growth[-1] > 3.5
    # And at 512 tokens the difference is already an order of magnitude.
    assert naive[-1] > 10 * flash[-1]


@needs_triton
def test_flash_triton_saves_the_same_linear_memory():
    assert [saved_bytes("flash_triton", t) for t in (32, 64)] == [attention_saved_bytes_formula(t) for t in (32, 64)]


# ---- the model: same training whichever attention runs -------------------------------------------

def test_training_with_flash_torch_follows_the_sdpa_loss_curve(tiny_config, tmp_path, monkeypatch):
    from rich.console import Console

    from lmforge.train.loop import Trainer

    # Blocks of 16 make the 64-token windows span 4 x 4 tiles, so the tiling is exercised; the
    # counter proves the flash run really went through flash_torch.
    calls = []

    def small_blocks(q, k, v, causal, window=None):
        calls.append(q.shape)
        return flash_attention_torch(q, k, v, causal=causal, window=window, block_q=16, block_k=16)

    monkeypatch.setattr(attention_module, "flash_attention_torch", small_blocks)
    curves = {}
    for backend in ("sdpa", "flash_torch"):
        cfg = tiny_config(f"model.attention={backend}", max_steps=5)
        trainer = Trainer(cfg, tmp_path / backend, console=Console(quiet=True), progress=False)
        calls.clear()  # the plan's roofline traces a step (on fake tensors) while the Trainer is set up
        curves[backend] = torch.stack([trainer.train_step()[0] for _ in range(5)])
    assert len(calls) == 5 * 2  # five steps through both layers (flash_torch's run, the last)
    torch.testing.assert_close(curves["flash_torch"], curves["sdpa"], atol=1e-4, rtol=1e-5)


def test_kv_cache_generation_with_flash_torch_matches_sdpa():
    # Decoding feeds one query against all cached keys: the end-aligned causal mask with q_len < kv_len.
    from lmforge.config import make_config
    from lmforge.generate.sampling import generate
    from lmforge.model.transformer import Transformer

    continuations = {}
    for backend in ("sdpa", "flash_torch"):
        torch.manual_seed(0)
        model = Transformer(make_config("tiny", overrides=[f"model.attention={backend}"]).model).eval()
        continuations[backend] = generate(model, [5, 9, 2, 7, 11, 3], 16, temperature=0)
    assert continuations["flash_torch"] == continuations["sdpa"]
