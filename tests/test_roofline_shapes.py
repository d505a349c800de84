"""A step's own matmul calls timed alone (roofline/shapes.py) and read before the grid
(roofline.compute_rate): the layouts the trace records, which calls are timed and after how many
writes, and how the rates are cached with the roof they refine. No timed assertion."""

import dataclasses

import pytest
import torch

import lmforge.accounting.roofline.measure as measure
import lmforge.accounting.roofline.shapes as shapes
from lmforge.accounting.roofline import Roof, compute_rate
from lmforge.accounting.roofline.ops import Op, micro_batch_ops, step_matmul_shapes
from lmforge.config import make_config
from lmforge.train.roofline import one_process_engine

MIB = 2.0**20
CPU = torch.device("cpu")


def _roof(peak: float = 1e12, cache: float = 32 * MIB, **fields) -> Roof:
    flat = {d: [[1, 1, 1, peak]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, peak]] for d in ("float32", "bfloat16")}
    return Roof("synthetic", 1e10, flat, flat2, flat2, [[1, 1e9]], cache_bytes=cache, **fields)


def test_a_linear_layers_three_matmuls_are_traced_with_their_layouts():
    """F.linear's forward is x @ W^T ("nt"), its input gradient dy @ W ("nn"), its weight gradient
    dy^T @ x ("tn"): the three carry equal FLOPs in every layer of a model without biases."""
    cfg = make_config("tiny").model
    ops = [op for op in micro_batch_ops(one_process_engine, cfg, 2, 16) if op.cls == "matmuls"]
    by_layout = {}
    for op in ops:
        by_layout[op.layout] = by_layout.get(op.layout, 0.0) + op.flops
    assert set(by_layout) == {"nt", "nn", "tn"}
    assert by_layout["nt"] == by_layout["nn"] == by_layout["tn"]


def test_a_timed_call_is_read_before_the_grid_and_only_for_its_own_operator_layout_and_dtype():
    roof = _roof(peak=1e12, matmul_shapes={"float32": {"mm 64x32x16 nt": 2e11}})
    mm = Op("x", "matmuls", "matmul", 2.0 * 64 * 32 * 16, 0.0, (64, 32, 16), op="mm", layout="nt")
    assert compute_rate(roof, mm) == 2e11
    for other in (dataclasses.replace(mm, op="addmm"), dataclasses.replace(mm, layout="tn"),
                  dataclasses.replace(mm, dtype="bfloat16"), dataclasses.replace(mm, shape=(64, 32, 32))):
        assert compute_rate(roof, other) == pytest.approx(1e12)  # the grid's (exp of its log)
    # bf16-mixed's fp16 calls are priced at bf16's rates (roofline.rate_dtype): its timed ones too
    half = _roof(matmul_shapes={"bfloat16": {"mm 64x32x16 nt": 3e11}})
    assert compute_rate(half, dataclasses.replace(mm, dtype="float16")) == 3e11


def test_the_steps_calls_are_its_distinct_matmuls_in_the_dtype_that_prices_them():
    cfg = make_config("tiny", overrides=["train.precision=bf16-mixed"])
    calls = step_matmul_shapes(one_process_engine, cfg)
    traced = {("bfloat16", op.op, *op.shape, op.layout)
              for op in micro_batch_ops(one_process_engine, cfg.model, cfg.train.batch_size, cfg.seq_len, "bf16-mixed")
              if op.layout}
    assert set(calls) == traced and len(calls) == len(set(calls))
    assert {c[-1] for c in calls} == {"nt", "nn", "tn"}
    tp2 = make_config("tiny", overrides=["train.precision=bf16-mixed", "parallel.tp=2"])
    assert step_matmul_shapes(one_process_engine, tp2) == ()  # not traced: nothing to time


def test_a_step_writing_past_the_cache_is_timed_cold_and_one_within_it_in_cache():
    assert shapes.writes_before(3e9, 480 * MIB) == 480 * MIB
    assert shapes.writes_before(480 * MIB, 480 * MIB) == 480 * MIB
    assert shapes.writes_before(3e9, 32 * MIB) == 128 * MIB  # a small cache: cold after EVICT_MIB
    assert shapes.writes_before(28e6, 480 * MIB) == 0.0


def test_each_call_is_timed_once_after_the_writes_and_one_the_grid_prices_too_long_is_not(monkeypatch):
    timed = []
    real = shapes.time_shape

    def counting(*args):
        timed.append(args[:6])
        return real(*args)

    monkeypatch.setattr(shapes, "time_shape", counting)
    calls = (("float32", "mm", 64, 32, 16, "nt"), ("float32", "addmm", 64, 32, 16, "nt"),
             ("bfloat16", "mm", 16, 32, 64, "tn"))
    rates = shapes.timed_rates(_roof(), calls, 2**16, CPU, {})
    assert sorted(rates) == ["bfloat16", "float32"]
    assert sorted(rates["float32"]) == ["addmm 64x32x16 nt after 65536", "mm 64x32x16 nt after 65536"]
    assert all(rate > 0 for by_key in rates.values() for rate in by_key.values())
    assert len(timed) == 3
    assert shapes.timed_rates(_roof(), calls, 2**16, CPU, rates) == rates and len(timed) == 3  # known: not again
    again = shapes.timed_rates(_roof(), calls[:1], 2**20, CPU, rates)  # after more writes: its own timing
    assert "mm 64x32x16 nt after 1048576" in again["float32"] and len(timed) == 4
    # the grid prices this call at 2 * 64 * 32 * 16 / 1e3 = 65 s, past SHAPE_SECONDS: left on the grid
    assert shapes.timed_rates(_roof(peak=1e3), calls[:1], 2**16, CPU, {}) == {} and len(timed) == 4
    # a call whose tensors pass SHAPE_BYTES (here 64 x 2^22 fp32 and its result: 2 GiB) is not timed either
    wide = ("float32", "mm", 64, 2**22, 16, "nn")
    assert shapes.timed_rates(_roof(peak=1e15), (wide,), 2**16, CPU, {}) == {} and len(timed) == 4
    # the roof carries the step's rates by call, those after its own writes
    after = again["float32"]["mm 64x32x16 nt after 1048576"]
    assert shapes.at_writes(again, 2**20) == {"float32": {"mm 64x32x16 nt": after}, "bfloat16": {}}


def test_the_rates_are_cached_with_their_roof_and_measured_again_with_it(monkeypatch, tmp_path):
    """this_step_roof times the step's calls once and stores them in the roof's cache entry;
    cached_step_roof reads them without timing; a roof measured again drops and re-times them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fields = dataclasses.asdict(_roof())
    fields = {k: v for k, v in fields.items() if k not in ("name", "source", "matmul_shapes", "collective")}
    roofs = []
    monkeypatch.setattr(measure, "measure_roof", lambda device: roofs.append(1) or fields)
    timed = []
    monkeypatch.setattr(shapes, "time_shape", lambda *args: timed.append(args) or 1e11)
    cfg = make_config("tiny")
    calls = step_matmul_shapes(one_process_engine, cfg)

    assert shapes.cached_step_roof(CPU, one_process_engine, cfg) is None  # nothing cached: nothing measured
    first = shapes.this_step_roof(CPU, one_process_engine, cfg)
    assert len(roofs) == 1 and len(timed) == len(calls)
    assert sum(len(by_key) for by_key in first.matmul_shapes.values()) == len(calls)
    assert set(first.matmul_shapes["float32"].values()) == {1e11}
    assert shapes.this_step_roof(CPU, one_process_engine, cfg) == first and len(timed) == len(calls)
    assert shapes.cached_step_roof(CPU, one_process_engine, cfg) == first
    assert shapes.this_step_roof(CPU).matmul_shapes == {}  # no step: the roof alone
    shapes.this_step_roof(CPU, one_process_engine, cfg, remeasure=True)
    assert len(roofs) == 2 and len(timed) == 2 * len(calls)
