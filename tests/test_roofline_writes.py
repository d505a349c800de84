"""Elementwise rates by the bytes written since an operator's operands were last touched
(elementwise.measure_elementwise_after, roofline.rates_after, ops.step_roof): the
grid's arithmetic, the step's count of written bytes it is read at, and what the measurement runs.
No timed assertion."""

import dataclasses
import math

import pytest
import torch

import lmforge.accounting.roofline.elementwise as measure
from tests.plan_configs import config_of
from lmforge.accounting.roofline import Roof, rates_after
from lmforge.accounting.roofline.ops import _touched, predict_step, step_roof, written_bytes
from lmforge.accounting.roofline.trace import record_step
from lmforge.config import make_config
from lmforge.train.roofline import one_process_engine

MIB = 2.0**20


def _roof(after: dict, cold: dict, cache: float = 32 * MIB) -> Roof:
    flat = {d: [[1, 1, 1, 1e12]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e12]] for d in ("float32", "bfloat16")}
    return Roof("synthetic", 1e10, flat, flat2, flat2, [[1, 1e9]], elementwise_ops=cold,
                elementwise_ops_after=after, cache_bytes=cache)


# one family: at 1 kB and 1 MB a call, after 2, 8 and 128 MiB of other writes
AFTER = {"binary": [[1e3, 2 * MIB, 8e9], [1e6, 2 * MIB, 4e10], [1e3, 8 * MIB, 2e9], [1e6, 8 * MIB, 1e10],
                    [1e3, 128 * MIB, 1e9], [1e6, 128 * MIB, 5e9]]}
COLD = {"binary": [[1e3, 1e9], [1e6, 5e9]]}


def test_a_grid_point_reads_its_measured_rates():
    assert rates_after(_roof(AFTER, COLD), 8 * MIB) == {"binary": [[1e3, pytest.approx(2e9)],
                                                                   [1e6, pytest.approx(1e10)]]}


def test_between_two_ws_the_rate_is_interpolated_in_log_w():
    """4 MiB is halfway from 2 to 8 MiB in log2: the geometric mean of the two rows' rates."""
    rates = dict(rates_after(_roof(AFTER, COLD), 4 * MIB)["binary"])
    assert rates[1e3] == pytest.approx(math.sqrt(8e9 * 2e9), rel=1e-12)
    assert rates[1e6] == pytest.approx(math.sqrt(4e10 * 1e10), rel=1e-12)


def test_outside_the_grid_the_rate_is_its_edges():
    """Fewer writes than the smallest W read that W's rates; more than the largest, the cold ones."""
    roof = _roof(AFTER, COLD)
    assert rates_after(roof, 1.0)["binary"] == [[1e3, pytest.approx(8e9)], [1e6, pytest.approx(4e10)]]
    assert rates_after(roof, 1e12)["binary"] == [[1e3, pytest.approx(1e9)], [1e6, pytest.approx(5e9)]]


def test_the_step_is_priced_at_the_rates_after_its_own_writes():
    """tiny's step (28 MiB written) on the synthetic roof: every elementwise op at the grid read at
    written_bytes; small's (over a GB) at the cold rates, exactly what a roof without the grid gives."""
    for model, written_over in (("tiny", False), ("small", True)):
        cfg = make_config(model, overrides=["train.batch_size=2", "train.seq_len=64"] if model == "small" else [])
        written = written_bytes(one_process_engine, cfg)
        roof = _roof(AFTER, COLD)
        assert (written > 128 * MIB) == written_over
        assert step_roof(one_process_engine, cfg, 1, roof).elementwise_ops == rates_after(roof, written)
        expected = dataclasses.replace(roof, elementwise_ops=rates_after(roof, written), elementwise_ops_after={})
        got = predict_step(one_process_engine, cfg, 1, roof, "none")
        want = predict_step(one_process_engine, cfg, 1, expected, "none")["seconds_per_step"]
        assert got["seconds_per_step"] == pytest.approx(want, rel=1e-12)
        if written_over:  # past the grid: the cold rates, as before the grid existed
            old = dataclasses.replace(roof, elementwise_ops_after={})
            want = predict_step(one_process_engine, cfg, 1, old, "none")["seconds_per_step"]
            assert got["seconds_per_step"] == pytest.approx(want, rel=1e-12)


def test_a_roof_without_the_grid_keeps_its_rates():
    cfg = make_config("tiny")
    roof = _roof({}, COLD)
    assert step_roof(one_process_engine, cfg, 1, roof) is roof


def test_written_bytes_are_what_a_real_step_writes():
    """The count the grid is read at: the bytes of every non-view result of the fake trace's
    forward, backward, clip and AdamW step equal those of the same step on real tensors."""
    cfg = dataclasses.replace(make_config("tiny").model, n_layers=2)
    real = record_step(one_process_engine, cfg, 2, 16, "fp32", fake=False)
    assert written_bytes(one_process_engine, config_of(cfg, "train.batch_size=2", "train.seq_len=16")) == sum(
        _touched(t) for r in real if not r.is_view for t in r.outputs)


def test_the_measurement_follows_each_fraction_of_the_cache_and_ends_on_the_cold_grid(monkeypatch):
    """A regular grid: every family at every call size after 64 KiB, 2 MiB and cache x
    AFTER_CACHE_FRACTIONS bytes (each W once), then the cold grid's row at EVICT_MIB; an unknown
    cache (0) measures nothing."""
    monkeypatch.setattr(measure, "ELEMENTWISE_SIZES", (2**12,))
    device = torch.device("cpu")
    cold = {"binary": [[3 * 4 * 2**12, 1.0]]}
    cache = 1 * MIB
    grid = measure.measure_elementwise_after(device, cold, cache)
    families = set(measure._family_calls(2**12, device))
    assert set(grid) == families
    ws = [2**16, cache / 4, cache / 2, 3 * cache / 4, cache, 2 * MIB]  # cache / 16 is 64 KiB: measured once
    assert measure.after_writes(cache) == sorted(ws)
    # a last level past EVICT_MIB: every fraction below it, the cold grid's W the cache itself (cold_writes)
    assert measure.after_writes(1024 * MIB) == [2**16, 2 * MIB, 64 * MIB, 256 * MIB, 512 * MIB, 768 * MIB]
    assert measure.cold_writes(1024 * MIB) == 1024 * MIB and measure.cold_writes(cache) == measure.EVICT_MIB * MIB
    for family, rows in grid.items():
        assert sorted(w for _, w, _ in rows) == sorted(ws + ([measure.EVICT_MIB * MIB] if family == "binary" else []))
        assert all(rate > 0 for _, _, rate in rows)
    assert grid["binary"][-1] == [3 * 4 * 2**12, measure.EVICT_MIB * MIB, 1.0]
    assert measure.measure_elementwise_after(device, cold, 0.0) == {}


def test_ranks_sharing_the_cache_write_into_it_together():
    """On a CPU's last level (cache_shared) the dp ranks of the machine each write a step's bytes
    into the one cache: the grid is read at dp x written; a GPU's own L2 at one rank's."""
    cfg = make_config("tiny", overrides=["train.parallel=ddp"])
    written = written_bytes(one_process_engine, cfg)
    shared = _roof(AFTER, COLD, cache=32 * MIB)
    shared = dataclasses.replace(shared, cache_shared=True)
    assert step_roof(one_process_engine, cfg, 2, shared).elementwise_ops == rates_after(shared, 2 * written)
    own = dataclasses.replace(shared, cache_shared=False)
    assert step_roof(one_process_engine, cfg, 2, own).elementwise_ops == rates_after(own, written)
