"""The pieces of the roofline that issue 24's accuracy work added, checked without a clock: the
families of clipping's norms and of NLL, a
foreach op priced at its whole list's size, the warm/cold choice by what a step writes against
the cache, and the profiler's attribution of a kernel's inner operators (bench/step_time.py)."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tests.plan_configs import config_of
from lmforge.accounting.roofline import Roof, family_of, memory_rate, op_time
from lmforge.accounting.roofline.elementwise import cache_bytes
from lmforge.accounting.roofline.ops import Op, predict_step, written_bytes
from lmforge.accounting.roofline.trace import trace_step
from lmforge.config import make_config
from lmforge.train.roofline import one_process_engine


def test_families_of_norms_and_nll():
    assert family_of("linalg_vector_norm") == "vector_norm"  # a whole tensor, not RMSNorm's row mean
    assert family_of("mean") == "reduce"
    assert family_of("nll_loss_backward") == "unary"  # a fill
    assert family_of("nll_loss_forward") == "copy"  # a gather
    assert family_of("_log_softmax") == "softmax"
    # in place, a binary op writes over what it read (no write-allocate): its own measured rate
    assert family_of("mul_") == family_of("_foreach_addcdiv_") == "binary_inplace"
    assert family_of("mul") == family_of("_foreach_add") == "binary"
    assert family_of("fill_") == family_of("_foreach_sqrt") == "unary"


def test_an_inplace_op_falls_back_to_its_familys_rate_on_an_older_roof():
    roof = _roof(cold=1e9, warm=1e11)  # no binary_inplace grid
    op = Op("x", "norms/elementwise", "elementwise", 0.0, 1e6, (), 1, "float32", "mul_")
    assert memory_rate(roof, op) == pytest.approx(1e10, rel=1e-12)  # binary's rate at 1 MB
    fast = dataclasses.replace(roof, elementwise_ops={**roof.elementwise_ops, "binary_inplace": [[1, 5e10]]})
    assert memory_rate(fast, op) == pytest.approx(5e10, rel=1e-12)


def test_gelu_is_priced_at_the_adds_rate():
    """tanh GELU and its backward are binary ops by bytes (their own per-element families moved
    predicted/measured by less than the run-to-run spread: docs/roofline.md)."""
    assert family_of("gelu") == family_of("gelu_backward") == "binary"


def _roof(cold: float, warm: float, cache: float = 0.0) -> Roof:
    """Flat rates: `cold` bytes/s for elementwise families out of cache, `warm` after up to
    `cache` bytes of other writes (cold again after 4x that), the binary family 10x faster at 1 MB
    a call than at 1 kB; no cache (0): no grid by writes."""
    flat = {d: [[1, 1, 1, 1e12]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e12]] for d in ("float32", "bfloat16")}  # SDPA's (T, head_dim) grids
    families = {f: [[1, cold]] for f in ("unary", "copy", "reduce", "vector_norm", "softmax")}
    families["binary"] = [[1e3, cold], [1e6, 10 * cold]]
    after = {f: [[size, cache, warm] for size, _ in rows] + [[size, 4 * cache, rate] for size, rate in rows]
             for f, rows in families.items()} if cache else {}
    return Roof("synthetic", 1e11, flat, flat2, flat2, [[1, cold]], elementwise_ops=families,
                elementwise_ops_after=after, cache_bytes=cache)


def test_a_foreach_op_streams_its_whole_list_and_an_elementwise_op_each_call():
    roof = _roof(cold=1e9, warm=1e11)
    foreach = Op("adamw", "optimizer", "foreach", 0.0, 1e6, (), 1000, "float32", "_foreach_mul_")
    assert memory_rate(roof, foreach) == pytest.approx(1e10, rel=1e-12)  # 1 MB in all, not 1 kB a tensor
    loop = dataclasses.replace(foreach, kind="elementwise", op="mul_")
    assert memory_rate(roof, loop) == pytest.approx(1e9, rel=1e-12)  # 1000 calls of 1 kB each
    assert op_time(roof, foreach)["memory_s"] == pytest.approx(1e6 / 1e10, rel=1e-12)


def test_a_step_that_fits_in_the_cache_is_priced_warm():
    """The same step on two roofs that differ only in cache size: written_bytes under the cache
    reads the warm rates (100x faster here), 4x over it the cold ones, so norms/elementwise' memory
    time drops 10-100x (binary's cold rate is 10x faster at 1 MB a call)."""
    cfg = make_config("tiny")
    written = written_bytes(one_process_engine, cfg)
    cold = predict_step(one_process_engine, cfg, 1, _roof(1e9, 1e11, cache=written / 4), cfg.train.parallel)
    warm = predict_step(one_process_engine, cfg, 1, _roof(1e9, 1e11, cache=written), cfg.train.parallel)
    ratio = cold["classes"]["norms/elementwise"]["memory_s"] / warm["classes"]["norms/elementwise"]["memory_s"]
    # every norms/elementwise op has a family here (flat 1e9 cold) but binary's 1e10 at >= 1 MB a call
    assert 10 <= ratio <= 100
    assert warm["classes"]["matmuls"]["seconds"] == cold["classes"]["matmuls"]["seconds"]


def test_written_bytes_extends_by_layer_exactly():
    """written_bytes of 5 layers from traces of 2 and 3 equals the sum over a direct 5-layer trace
    (the blocks are identical: layer_extrapolated's argument)."""
    from lmforge.accounting.roofline.ops import _touched

    cfg = dataclasses.replace(make_config("tiny").model, n_layers=5)
    records = trace_step(one_process_engine, cfg, 2, 16, "fp32")
    direct = sum(_touched(t) for r in records if not r.is_view for t in r.outputs)
    assert written_bytes(one_process_engine, config_of(cfg, "train.batch_size=2", "train.seq_len=16")) == direct


def test_this_cpus_cache_is_read_from_linux():
    if not Path("/sys/devices/system/cpu/cpu0/cache/index0/size").exists():
        pytest.skip("no cache sizes under /sys")
    size = cache_bytes(torch.device("cpu"))
    assert size >= 2**15 and size == int(size)  # at least a 32 KiB L1, in whole bytes


def _step_time_bench():
    """bench/step_time.py, loaded by path (bench/ is scripts, not an installed package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profiler_gives_a_kernels_inner_operators_its_class():
    """NLL's backward zero-fills its gradient (aten::zero_ below aten::nll_loss_backward): the
    loss's time, not norms/elementwise' (the trace counts the fill in nll_loss_backward's bytes);
    backward()'s own ones_like (a fill_ below no kernel) stays norms/elementwise'."""
    logits = torch.randn(64, 128, requires_grad=True)
    targets = torch.randint(0, 128, (64,))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.cross_entropy(logits, targets).backward()
        (logits.detach() * 2).sum()
    class_of_event = _step_time_bench().class_of_event
    classes = {}
    for event in prof.events():
        classes.setdefault(event.name, set()).add(class_of_event(event))
    assert classes["aten::zero_"] == {"loss"} and classes["aten::nll_loss_backward"] == {"loss"}
    assert classes["aten::fill_"] == {"norms/elementwise"}
    assert classes["aten::mul"] == {"norms/elementwise"}
