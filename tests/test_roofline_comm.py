"""The roofline's communication term on a synthetic network, no clock: the bytes each rank sends
in a ring all-reduce (2 (N-1)/N of the payload) or a ZeRO-2 reduce-scatter + all-gather (the same,
on the padded shards), against the model's own parameter count, at one latency per collective plus
bytes over bandwidth."""

import pytest

from lmforge.accounting.comm import unit_sizes
from lmforge.accounting.plan.make import Setup, make_plan
from lmforge.accounting.roofline import Roof
from lmforge.config import make_config
from lmforge.model.transformer import Transformer

LATENCY, BANDWIDTH = 1e-4, 1e9  # seconds per collective, bytes/s


def _roof() -> Roof:
    flat = {d: [[1, 1, 1, 1e12]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e12]] for d in ("float32", "bfloat16")}
    return Roof("synthetic", 1e11, flat, flat2, flat2, [[1, 1e11]],
                collective={"latency_s": LATENCY, "bytes_per_second": BANDWIDTH})


@pytest.mark.parametrize("strategy, ranks", [("ddp", 2), ("ddp", 4), ("zero2", 2), ("zero2", 3)])
def test_the_communication_term_is_a_rings_bytes_over_bandwidth_plus_latencies(strategy, ranks):
    cfg = make_config("tiny").model
    psi = sum(p.numel() for p in Transformer(cfg).parameters())  # tied embedding counted once
    units = unit_sizes(cfg)
    assert sum(units.values()) == psi
    setup = Setup(dp=ranks, parallel=strategy, zero_stage=2 if strategy == "zero2" else 0, mfu=1.0)
    plan = make_plan(cfg, setup, ("this machine", 1e12, 2**34), _roof())
    comm = plan["roofline"]["classes"]["communication"]
    # ddp: one all-reduce of every gradient; zero2: reduce-scatter then all-gather of each unit's
    # shards, padded to a multiple of the ranks: the same 2 (N-1)/N per element as an all-reduce
    elements = psi if strategy == "ddp" else sum(-(-n // ranks) * ranks for n in units.values())
    sent = 2 * (ranks - 1) / ranks * elements * 4  # fp32 gradients and parameters
    assert comm["bytes"] == pytest.approx(sent, rel=1e-12)
    collectives = len(units) * (1 if strategy == "ddp" else 2)
    assert comm["seconds"] == pytest.approx(collectives * LATENCY + sent / BANDWIDTH, rel=1e-12)
    assert comm["bound"] == "memory"  # a collective's time is its network time (op_time: memory_s)
