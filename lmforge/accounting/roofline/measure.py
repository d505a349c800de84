"""Measuring this machine's roof (roofline.py's Roof): matmul FLOP/s over a grid of shapes per
dtype, the bandwidth of a large copy, SDPA FLOP/s by sequence length and head size (forward, and
backward), elementwise bytes/s by call size (operands out of cache, and after W bytes of other
writes up to the cache's size), the fixed cost of one operator of a model's step, and,
under torchrun, all-reduce latency and bandwidth on the launched backend.

Each figure is the best of a few short timings, as hardware.py's peak is (a moment when other
work shares the machine lowers some timings, not the best). The whole roof is measured in about
ten seconds (33 s where each cold timing first writes a 480 MiB last level) and cached with the
matmul peak (hardware.py's cache: when, under what load), and `lmforge plan --hardware this
--remeasure` replaces it. A step's own matmul calls are timed beside it: roofline/shapes.py.
"""

import dataclasses
import time

import torch
import torch.nn.functional as F

from lmforge.accounting.hardware import _calls_per_second, _measured, _sync, cached_field, device_name
from lmforge.accounting.roofline import Roof
from lmforge.accounting.roofline.elementwise import (cache_bytes, cold_writes, measure_elementwise_after,
                                                   measure_elementwise_ops)
from lmforge.accounting.roofline.trace import dispatched_calls
from lmforge.config import ModelConfig
from lmforge.model.transformer import Transformer

# The grid: every (M, N, K) with each dimension from MATMUL_DIMS. 64..1024 brackets the small
# models' widths; larger shapes are read at the grid's edge (their rate has saturated by then).
MATMUL_DIMS = (64, 256, 1024)
SDPA_SEQ = (64, 256, 1024)
SDPA_HEAD_DIMS = (16, 64)
SDPA_BATCH_HEADS = 8  # batch x heads of each timed SDPA call
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_rate(op, work: float, device: torch.device, runs: int = 2, seconds: float = 0.02) -> float:
    """Best `work` units per second of `op` over `runs` timings of about `seconds`, after a warm-up."""
    op()
    _sync(device)
    return max(work * _calls_per_second(op, device, seconds)[0] for _ in range(runs))


def measure_matmuls(device: torch.device, rows: tuple[int, ...] = MATMUL_DIMS, cold_megabytes: int = 0) -> dict:
    """{dtype: [[M, N, K, FLOP/s], ...]} over M in `rows`, N and K in MATMUL_DIMS. With
    `cold_megabytes` (decode.py's GEMV rows), each call's weight matrix is the next of the (K, N)
    matrices laid end to end in that many MiB (more than a CPU's last-level cache): a decode step
    reads each weight once per step, after every other layer's, so from memory, not from the cache
    a timing loop on one matrix would keep it in."""
    generator = torch.Generator(device).manual_seed(0)
    grid = {}
    for name, dtype in DTYPES.items():
        weights = torch.full((cold_megabytes * 2**20 // dtype.itemsize,), 0.5, device=device, dtype=dtype)
        grid[name] = []
        for m in rows:
            for n in MATMUL_DIMS:
                for k in MATMUL_DIMS:
                    a = torch.randn(m, k, device=device, generator=generator).to(dtype)
                    if cold_megabytes:
                        matrices = weights[:weights.numel() // (k * n) * (k * n)].view(-1, k, n)
                        turn = iter(range(10**12))
                        call = lambda: a @ matrices[next(turn) % len(matrices)]
                    else:
                        b = torch.randn(k, n, device=device, generator=generator).to(dtype)
                        call = lambda: a @ b
                    grid[name].append([m, n, k, _best_rate(call, 2 * m * n * k, device)])
    return grid


def _sdpa_seconds(heads: int, t: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of one causal SDPA call of (1, heads, t, d). The backward is
    timed on its own, again and again through one retained graph into fresh gradients
    (autograd.grad), as a model's backward runs it: a forward + backward timed together less the
    forward would also charge it a ones_like and three .grad accumulations that the model's
    backward does not pay (at T = 64 that over-predicted the kernel 1.5x)."""
    q, k, v = (torch.randn(1, heads, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        forward = 1 / _best_rate(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 1, device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.ones_like(out)
    backward = 1 / _best_rate(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), 1, device)
    return forward, backward


def measure_sdpa(device: torch.device) -> tuple[dict, dict]:
    """({dtype: [[T, head_dim, FLOP/s]]} forward, the same backward), causal, of whole calls of
    SDPA_BATCH_HEADS batch x heads, FLOPs counted as shapes.py does (4 * T^2 * head_dim per
    batch-head forward, the full T x T; 2x that backward)."""
    forward, backward = {}, {}
    for name, dtype in DTYPES.items():
        forward[name], backward[name] = [], []
        for t in SDPA_SEQ:
            for d in SDPA_HEAD_DIMS:
                flops = 4 * SDPA_BATCH_HEADS * t * t * d
                seconds = _sdpa_seconds(SDPA_BATCH_HEADS, t, d, dtype, device)
                forward[name].append([t, d, flops / seconds[0]])
                backward[name].append([t, d, 2 * flops / seconds[1]])
    return forward, backward


def measure_copy_bandwidth(device: torch.device, megabytes: int = 128) -> float:
    """Bytes/s of copying a `megabytes` MiB tensor into another (read once, written once)."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2 * src.nbytes, device, runs=3, seconds=0.05)


# a model whose every tensor is a few hundred bytes: its step is all fixed cost (roofline.py's launch term)
MINIMAL = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32)


def measure_launch(device: torch.device) -> tuple[float, float]:
    """(seconds per operator of MINIMAL's forward, cross-entropy and backward on 8 tokens, divided
    by the aten operators it dispatches as roofline/trace.py counts them, views included; seconds
    per tensor of a foreach op over 64 one-element tensors): the fixed cost every call pays before
    it moves a byte. A model's operator pays more than a bare one (a chain of one-element adds:
    2.4 us here against 4.0 us): the module calls, the Python between operators, the composite
    operators above the recorded ones (F.linear above t and mm) and autograd's bookkeeping."""
    model = Transformer(MINIMAL).to(device)
    tokens = torch.arange(8, device=device).view(1, 8)

    def step():
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()

    per_call = 1 / _best_rate(step, dispatched_calls(step), device, runs=3, seconds=0.05)
    tensors = [torch.ones(1, device=device) for _ in range(64)]
    per_tensor = 1 / _best_rate(lambda: torch._foreach_add_(tensors, 1.0), 64, device, runs=3)
    return per_call, per_tensor


def measure_roof(device: torch.device) -> dict:
    """This machine's roof as a JSON-ready dict (Roof's fields but its name and source). The global
    RNG is left as it was: a run that measures its roof first draws the dropout masks and batches
    of one that found it cached (tests/test_lora.py resumes such a pair bit for bit)."""
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        forward, backward = measure_sdpa(device)
        call, foreach = measure_launch(device)
        cache = cache_bytes(device)
        cold = measure_elementwise_ops(device, cold_writes(cache))
        return {"bandwidth": measure_copy_bandwidth(device),
                "matmul": measure_matmuls(device),
                "sdpa_forward": forward, "sdpa_backward": backward,
                "elementwise": cold["binary"],
                "elementwise_ops": cold, "cache_bytes": cache, "cache_shared": device.type == "cpu",
                "elementwise_ops_after": measure_elementwise_after(device, cold, cache),
                "call_seconds": call, "foreach_call_seconds": foreach, "view_call_seconds": call,
                "measure_seconds": time.perf_counter() - started}


def _key(device: torch.device) -> str:
    # v2: the per-family elementwise rates and the per-dispatched-call launch cost; v3: SDPA's
    # backward timed alone, elementwise rates on operands out of cache, the vector_norm and binary_inplace
    # families, SDPA's fixed cost (an older cached roof, without them, is measured again rather than read)
    # v4: the launch cost per operator of a minimal model's step, views alike (a chain of adds paid less)
    # v6: the optimizer phase's fixed cost measured whole (optimizer_phase; a v5 roof of this branch held an
    # earlier form of it)
    # v7: the families after W bytes of other writes (elementwise_ops_after) in place of the warm rates
    # v8: elementwise_ops_after also after 64 KiB and 2 MiB of writes (a decode step's, in a core's own caches);
    # the gelu and gelu_backward families; v9: the elementwise rates the best of 9 calls, not 3;
    # the collectives the median of 21 calls after 3 warm-up ones; v10: the cold rates after the last
    # level's size of writes, at least 128 MiB (cold_writes), and the after-W grid up to it; v11: the SDPA
    # grids the rate of whole calls (no fixed cost per call apart: a v10 grid held the work's rate alone)
    return f"roofline v11|{device_name(device)}|torch {torch.__version__}"


def this_roof(device: torch.device, remeasure: bool = False, store: bool = True) -> Roof:
    """This machine's roof, from the cache unless `remeasure` (hardware.py's cache and its rules); the
    collectives are measured on a launched group apart (bench/collectives.py)."""
    return _roof(device, _measured(_key(device), "roof", lambda: measure_roof(device), remeasure, store))


def cached_roof(device: torch.device) -> Roof | None:
    """This machine's roof if the cache holds one (never measured here: the end of a training run
    reads a roof, it never spends half a minute measuring one), else None."""
    fields = cached_field(_key(device), "roof")
    return _roof(device, fields) if isinstance(fields, dict) else None


def _roof(device: torch.device, fields: dict) -> Roof:
    # a roof cached by an older lmforge may hold measures since dropped (optimizer_phase, sdpa_call_seconds): ignored
    known = {f.name for f in dataclasses.fields(Roof)}
    fields = {k: v for k, v in fields.items() if k in known}
    return Roof(name=f"this machine: {device_name(device)}", **fields)
