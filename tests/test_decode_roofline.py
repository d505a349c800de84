"""The decode step's roofline (accounting/roofline/decode.py) without a
clock: the traced operators against a real step's, their bytes against the tensors' sizes (the KV
cache read per step, every weight read once), the GEMV grid joined to the training grid, and what
`lmforge plan --inference` prints. Nothing here asserts a time."""

import json

import pytest
import torch

from lmforge.accounting.roofline import Roof, interpolate, op_time
from lmforge.accounting.shapes import model_shapes
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.accounting.roofline.decode import decode_op, decode_roof, plan_decode, predict_decode, record_decode
from lmforge.train.roofline import decode_step


def decode_ops(decoder, cfg, batch: int, context: int, dtype: torch.dtype = torch.float32) -> list:
    """The roofline's ops (decode.decode_op) of one decode step's records."""
    return [decode_op(r) for r in record_decode(decoder, cfg, batch, context, dtype)]


def test_the_fake_decode_trace_is_what_a_real_step_dispatches():
    cfg = make_config("tiny").model
    fake, real = record_decode(decode_step, cfg, 2, 40), record_decode(decode_step, cfg, 2, 40, fake=False)
    assert [r.op for r in fake] == [r.op for r in real]
    # shapes and dtypes of every tensor alike (a view's strides over size-1 dimensions may differ: no bytes)
    def shapes(records):
        return [[t[::2] for t in r.inputs + r.outputs] for r in records]  # (shape, dtype) of each tensor

    assert shapes(fake) == shapes(real)
    assert sum(r.op == "mm" for r in fake) == 7 * cfg.n_layers + 1  # q, k, v, o, gate, up, down; the head


@pytest.mark.parametrize("batch, context, dtype", [(1, 40, torch.float32), (8, 200, torch.bfloat16)])
def test_a_decode_step_reads_the_kv_cache_and_every_weight_once(batch, context, dtype):
    cfg = make_config("small").model
    ops = decode_ops(decode_step, cfg, batch, context, dtype)
    records = record_decode(decode_step, cfg, batch, context, dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    attention = [r for r in records if r.op.startswith("_scaled_dot_product")]
    assert len(attention) == cfg.n_layers
    kv_read = sum(sum(k[0][0] * k[0][1] * k[0][2] * k[0][3] for k in r.inputs[1:3]) for r in attention) * itemsize
    # 2 (keys, values) x layers x kv heads x head dim x positions attended (the context and the new token)
    assert kv_read == 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * (context + 1) * itemsize * batch
    # every matmul's weight read once: the block's and the LM head's (tied: the embedding table)
    weights = sum(r.inputs[1][0][0] * r.inputs[1][0][1] for r in records if r.op == "mm") * itemsize
    assert weights == (model_shapes(cfg).block_matmul_weights + cfg.vocab_size * cfg.d_model) * itemsize
    # attention FLOPs: one query per head against context + 1 keys, 4 FLOPs per key and feature
    attn_flops = sum(op.flops for op in ops if op.kind == "sdpa_forward")
    assert attn_flops == 4 * batch * cfg.n_heads * (context + 1) * cfg.head_dim * cfg.n_layers
    matmul_flops = sum(op.flops for op in ops if op.cls == "matmuls")
    assert matmul_flops == 2 * batch * weights / itemsize


def _roof(call=1e-6) -> Roof:
    """A synthetic roof: matmuls at M = 64, 256 faster than at M = 1, 8 (GEMV rows joined below)."""
    dims = (64, 256)
    matmul = {d: [[m, n, k, 1e10 * m / 64] for m in dims for n in dims for k in dims] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e10]] for d in ("float32", "bfloat16")}
    return Roof("synthetic", 1e10, matmul, flat2, flat2, [[1, 1e10]], call_seconds=1.0)


def test_the_gemv_rows_extend_the_grid_downward_and_set_the_launch_cost():
    gemv = {d: [[m, n, k, 1e8 * m] for m in (1, 8) for n in (64, 256) for k in (64, 256)] for d in ("float32",)}
    roof = decode_roof(_roof(), {"gemv": gemv, "call_seconds": 2e-6})
    grid = roof.matmul["float32"]
    assert sorted({r[0] for r in grid}) == [1, 8, 64, 256]  # one regular grid in M
    assert interpolate(grid, (1, 64, 64)) == pytest.approx(1e8)
    assert interpolate(grid, (8, 256, 64)) == pytest.approx(8e8)
    assert interpolate(grid, (64, 64, 64)) == pytest.approx(1e10)  # the training grid's rows unchanged
    assert roof.matmul["bfloat16"] == _roof().matmul["bfloat16"]  # no GEMV rows of that dtype: as it was
    assert roof.call_seconds == roof.view_call_seconds == 2e-6
    assert decode_roof(_roof(), None) == _roof()  # a datasheet roof: as it is


def test_a_decode_step_is_the_sum_of_its_ops_and_tokens_are_the_batch():
    cfg = make_config("tiny").model
    gemv = {d: [[m, n, k, 1e9] for m in (1, 8) for n in (64, 256) for k in (64, 256)] for d in ("float32", "bfloat16")}
    roof = decode_roof(_roof(), {"gemv": gemv, "call_seconds": 3e-6})
    predicted = predict_decode(decode_step, cfg, 8, 30, roof)
    ops = decode_ops(decode_step, cfg, 8, 30)
    assert predicted["seconds_per_step"] == pytest.approx(sum(op_time(roof, op)["seconds"] for op in ops), rel=1e-12)
    launches = sum(row["launch_s"] for row in predicted["classes"].values())
    assert launches == pytest.approx(3e-6 * sum(op.calls for op in ops), rel=1e-12)  # every call, views too
    assert predicted["tokens_per_second"] == pytest.approx(8 / predicted["seconds_per_step"], rel=1e-12)


def test_a_decode_step_is_priced_at_the_rates_after_its_own_writes():
    """The elementwise rates of a decode step are the grid's read at the bytes the step writes
    (every non-view result: tiny at batch 8 writes about 160 kB), as a training step's are: here
    between the grid's 64 KiB and 2 MiB rows, so neither row's rates alone."""
    import dataclasses

    from lmforge.accounting.roofline import rates_after
    from lmforge.accounting.roofline.ops import records_written

    cfg = make_config("tiny").model
    written = records_written(record_decode(decode_step, cfg, 8, 30))
    # the fake trace's count is a real step's
    assert written == records_written(record_decode(decode_step, cfg, 8, 30, fake=False))
    assert 2**16 < written < 2**21
    after = {"binary": [[1e3, 2.0**16, 8e9], [1e6, 2.0**16, 4e10], [1e3, 2.0**21, 1e9], [1e6, 2.0**21, 5e9]]}
    roof = dataclasses.replace(_roof(call=0.0), elementwise_ops_after=after, call_seconds=0.0)
    predicted = predict_decode(decode_step, cfg, 8, 30, roof)
    priced = dataclasses.replace(roof, elementwise_ops=rates_after(roof, written))
    ops = decode_ops(decode_step, cfg, 8, 30)
    assert predicted["seconds_per_step"] == pytest.approx(sum(op_time(priced, op)["seconds"] for op in ops), rel=1e-12)
    at_edges = [sum(op_time(dataclasses.replace(roof, elementwise_ops=rates_after(roof, w)), op)["seconds"]
                    for op in ops) for w in (2.0**16, 2.0**21)]
    assert at_edges[0] < predicted["seconds_per_step"] < at_edges[1]


@pytest.mark.parametrize("setup, why", [
    ({"tp": 2, "weights": "fp32", "kv_dtype": "fp32"}, "tensor parallelism"),
    ({"tp": 1, "weights": "int4", "kv_dtype": "bf16"}, "no quantised kernels"),
    ({"tp": 1, "weights": "bf16", "kv_dtype": "fp8"}, "KV cache is in the weights' dtype"),
])
def test_what_the_decode_trace_does_not_cover_says_why(setup, why):
    plan = {"setup": {"batch_size": 1, "seq_len": 16, **setup}}
    assert why in plan_decode(decode_step, make_config("tiny").model, plan, _roof())["none"]


def test_plan_inference_shows_the_roofline_decode_on_this_machine(capsys):
    args = ["plan", "--inference", "--model", "tiny", "--weights", "fp32", "--kv-dtype", "fp32", "--seq-len", "32"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    decode = plan["decode_roofline"]
    assert decode["batch"] == 1 and decode["context"] == 31 and decode["seconds_per_step"] > 0
    assert set(decode["classes"]) == {"matmuls", "attention", "norms/elementwise"}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode by the roofline" in out and "by class" in out
    assert main(["plan", "--inference", "--model", "tiny", "--weights", "int4"]) == 0
    assert "not predicted: int4 weights" in capsys.readouterr().out
