"""The roofline's communication term on a synthetic network, no clock: the bytes each rank sends
in a ring all-reduce (2 (N-1)/N of the payload) or a ZeRO-2 reduce-scatter + all-gather (the same,
on the padded shards), against the model's own parameter count; each operator at its own latency
per call plus bytes over its bandwidth, the step's scalar all-reduces at one latency each."""

import pytest

from lmforge.accounting.comm import step_collectives, unit_sizes
from lmforge.accounting.plan.make import Costing
from lmforge.accounting.roofline import Roof
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.modes import get_policy
from test_roofline import datasheet_plan  # bare: roofline_dist_worker.py imports this module from tests/

# seconds per call and bytes/s of each operator, all different: a term priced at another's shows
NETWORK = {"all_reduce": (1e-4, 1e9), "reduce_scatter": (3e-4, 5e8), "all_gather": (2e-4, 2e9)}


def _roof() -> Roof:
    flat = {d: [[1, 1, 1, 1e12]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e12]] for d in ("float32", "bfloat16")}
    operators = {name: {"latency_s": t, "bytes_per_second": b} for name, (t, b) in NETWORK.items()}
    return Roof("synthetic", 1e11, flat, flat2, flat2, [[1, 1e11]],
                collective={**operators["all_reduce"], "operators": operators})


@pytest.mark.parametrize("strategy, ranks", [("ddp", 2), ("ddp", 4), ("zero2", 2), ("zero2", 3)])
def test_the_communication_term_is_each_operators_bytes_over_bandwidth_plus_latencies(strategy, ranks):
    cfg = make_config("tiny").model
    psi = sum(p.numel() for p in Transformer(cfg).parameters())  # tied embedding counted once
    units = unit_sizes(cfg)
    assert sum(units.values()) == psi
    run = make_config("tiny", overrides=[f"train.parallel={strategy}"])
    plan = datasheet_plan(run, Costing(dp=ranks, mfu=1.0), _roof())
    comm = plan["roofline"]["classes"]["communication"]
    # ddp: one all-reduce of every gradient (tiny's fit one 25 MiB bucket); zero2: reduce-scatter
    # then all-gather of each unit's shards, padded to a multiple of the ranks: the same 2 (N-1)/N
    # per element as an all-reduce
    elements = psi if strategy == "ddp" else sum(-(-n // ranks) * ranks for n in units.values())
    sent = 2 * (ranks - 1) / ranks * elements * 4  # fp32 gradients and parameters
    assert comm["bytes"] == pytest.approx(sent, rel=1e-12)
    scalars = 2 + (strategy == "zero2")  # target count, loss; ZeRO's sharded gradient norm
    latency, bandwidth = NETWORK["all_reduce"]
    if strategy == "ddp":
        expected = (1 + scalars) * latency + sent / bandwidth
    else:
        (rs_latency, rs_bandwidth), (ag_latency, ag_bandwidth) = NETWORK["reduce_scatter"], NETWORK["all_gather"]
        expected = (scalars * latency + len(units) * (rs_latency + ag_latency)
                    + sent / 2 / rs_bandwidth + sent / 2 / ag_bandwidth)
    assert comm["seconds"] == pytest.approx(expected, rel=1e-12)
    assert comm["bound"] == "memory"  # a collective's time is its network time (op_time: memory_s)


def test_an_older_roof_prices_every_collective_at_all_reduces_figures():
    cfg = make_config("tiny").model
    roof = _roof()
    old = Roof(roof.name, roof.bandwidth, roof.matmul, roof.sdpa_forward, roof.sdpa_backward, roof.elementwise,
               collective={"latency_s": 1e-4, "bytes_per_second": 1e9})
    run = make_config("tiny", overrides=["train.parallel=zero2"])
    comm = datasheet_plan(run, Costing(dp=2, mfu=1.0), old)["roofline"]["classes"]["communication"]
    calls = sum(step_collectives(cfg, "zero2", 2).values())
    assert comm["seconds"] == pytest.approx(calls * 1e-4 + comm["bytes"] / 1e9, rel=1e-12)


@pytest.mark.parametrize("bucket_mb, buckets", [(25.0, 1), (0.1, None)])
def test_ddp_all_reduces_one_bucket_at_a_time(bucket_mb, buckets):
    """parallel/ddp.py's rule: gradients in the order backward makes them (the parameters reversed),
    a new bucket when the next would pass bucket_mb MiB."""
    cfg = make_config("tiny").model
    sizes = [p.numel() * 4 for p in dict.fromkeys(Transformer(cfg).parameters())]
    if buckets is None:  # counted here by the same rule, independently of comm.py's loop
        buckets, size = 1, 0
        for nbytes in reversed(sizes):
            if size and size + nbytes > bucket_mb * 2**20:
                buckets, size = buckets + 1, 0
            size += nbytes
        assert buckets > 3
    calls = step_collectives(cfg, "ddp", 2, get_policy("fp32"), bucket_mb=bucket_mb)
    assert calls == {"all_reduce": buckets, "scalar_all_reduce": 2}
