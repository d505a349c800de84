"""A step's own matmul calls, each timed alone, its operands in cache or out of it as the step
leaves them (roofline.Roof.matmul_shapes), read before the roof's grid.

Two things the grid (measure.MATMUL_DIMS: three sizes a dimension, operands in cache)
does not see, on the 2-core Intel VM (bench/matmul_shapes.py):
- the kernel library (oneDNN) picks its kernel by shape and operand layout, so the rate is not
  smooth between grid points: bf16 (1024, 768, 768) runs at 1.6 TFLOP/s, (1024, 2304, 768) at
  3.3, and x^T @ dy at half the rate of x @ W at some shapes;
- a step that writes more than the cache finds a matmul's operands out of it: after 512 MiB of
  writes (past the 480 MiB last level) GPT-2's bf16 matmuls took 1.0-1.8x their in-cache time,
  fp32 1.0-1.24x.
The grid priced GPT-2's bf16 matmuls at 0.72-0.81 of their profiled time. So the plan times the
step's own calls (ops.step_matmul_shapes: a dozen for GPT-2, seconds in all), cold where
the step writes more than the cache (writes_before), and caches the rates in the roof's cache
entry: a roof measured again drops them with the rest. A call the grid prices above
SHAPE_SECONDS, or whose tensors pass SHAPE_BYTES, is not timed (a large model's head on a CPU:
seconds a call and gigabytes) and stays on the grid.
"""

import dataclasses

import torch

from lmforge.accounting.hardware import cached_field, store_field
from lmforge.accounting.roofline import Roof, interpolate, shape_key
from lmforge.accounting.roofline.elementwise import _cold_rate, cold_writes
from lmforge.accounting.roofline.measure import DTYPES, _key, cached_roof, this_roof
from lmforge.accounting.roofline.ops import step_matmul_shapes, step_writes, traced

SHAPE_SECONDS = 0.25  # the longest call, as the grid prices it, timed on its own shape
SHAPE_BYTES = 2**29  # the most bytes of operands and result a timed call may allocate (GPT-2's fp32 head: 363 MB)
SHAPE_RUNS = 5  # each shape's time: the best of as many calls, each after the step's writes


def time_shape(dtype: str, operator: str, m: int, n: int, k: int, layout: str, after: float,
               device: torch.device) -> float:
    """FLOP/s of one (M, K) @ (K, N) matmul in `dtype` (`operator` addmm: plus a bias of N, as a
    linear layer's forward adds it; 4-10% slower than mm in bf16), each operand stored as `layout`
    says ("t": a transposed view of a contiguous tensor, as autograd passes x^T and W^T), the best
    of SHAPE_RUNS calls, each after `after` bytes of other writes (elementwise._cold_rate)."""
    generator = torch.Generator(device).manual_seed(0)

    def operand(*shape: int, transposed: bool = False) -> torch.Tensor:
        t = torch.randn(shape[::-1] if transposed else shape, device=device, generator=generator).to(DTYPES[dtype])
        return t.T if transposed else t

    a, b = operand(m, k, transposed=layout[0] == "t"), operand(k, n, transposed=layout[1] == "t")
    bias = operand(n)
    call = (lambda: torch.addmm(bias, a, b)) if operator == "addmm" else (lambda: torch.mm(a, b))
    return _cold_rate(call, 2 * m * n * k, device, runs=SHAPE_RUNS, evict_bytes=after)


def writes_before(written: float, cache: float) -> float:
    """The writes a step's calls are timed after: cold_writes(cache) where the step writes at least
    the cache's size, else none (operands in cache). Between the two the rates do not follow the
    step's writes: tiny's step writes 28 MB of the 480 MiB last level, and its calls timed after
    32 MiB of writes came out 1.44x its profiled matmuls, timed in cache about 1.0; small's and
    GPT-2's steps write more than the cache, and their calls timed cold came out 0.92-1.06."""
    return cold_writes(cache) if written >= cache else 0.0


def timed_rates(roof: Roof, shapes, after: float, device: torch.device, known: dict) -> dict:
    """{dtype: {"shape_key after W": FLOP/s}}: `known` with every call of `shapes`
    ((dtype, operator, M, N, K, layout)) it lacks timed after `after` bytes of writes, but those the
    grid prices above SHAPE_SECONDS a call or whose tensors pass SHAPE_BYTES."""
    rates = {dtype: dict(by_key) for dtype, by_key in known.items()}
    for dtype, operator, m, n, k, layout in shapes:
        key = f"{shape_key(operator, m, n, k, layout)} after {int(after)}"
        if key in rates.get(dtype, {}) or dtype not in DTYPES:
            continue
        nbytes = (m * k + k * n + m * n) * DTYPES[dtype].itemsize
        if 2 * m * n * k / interpolate(roof.matmul[dtype], (m, n, k)) <= SHAPE_SECONDS and nbytes <= SHAPE_BYTES:
            rates.setdefault(dtype, {})[key] = time_shape(dtype, operator, m, n, k, layout, after, device)
    return rates


def at_writes(rates: dict, after: float) -> dict:
    """Roof.matmul_shapes of a step: the rates timed after `after` bytes of writes, by shape_key."""
    suffix = f" after {int(after)}"
    return {dtype: {key.removesuffix(suffix): rate for key, rate in by_key.items() if key.endswith(suffix)}
            for dtype, by_key in rates.items()}


def this_step_roof(device: torch.device, build=None, cfg=None, dp: int = 1, remeasure: bool = False,
                   store: bool = True) -> Roof:
    """This machine's roof (measure.this_roof) and, given a step (`build`: the trainer's engine, as
    trace.trace_step takes it; `cfg`: the run's Config, on one of `dp` data-parallel ranks), the rates of
    its own matmul shapes after its writes, those not cached with the roof timed now (and cached, with `store`)."""
    roof = this_roof(device, remeasure=remeasure, store=store)
    shapes = step_matmul_shapes(build, cfg) if cfg is not None else ()
    if not shapes:  # no step, or one the trace does not cover
        return roof
    known = {} if remeasure and not store else cached_field(_key(device), "matmul_shapes") or {}
    after = writes_before(step_writes(build, cfg, dp, roof), roof.cache_bytes)
    rates = timed_rates(roof, shapes, after, device, known)
    if store and rates != known:
        store_field(_key(device), "matmul_shapes", rates)
    return dataclasses.replace(roof, matmul_shapes=at_writes(rates, after))


def cached_step_roof(device: torch.device, build, cfg, dp: int = 1) -> Roof | None:
    """This machine's roof and whatever rates of the step's shapes the cache holds with it, or None:
    nothing measured here (measure.cached_roof: the end of a training run measures nothing)."""
    roof = cached_roof(device)
    if roof is None or not traced(cfg):
        return roof
    after = writes_before(step_writes(build, cfg, dp, roof), roof.cache_bytes)
    return dataclasses.replace(roof, matmul_shapes=at_writes(cached_field(_key(device), "matmul_shapes") or {}, after))
