"""A decode step's time from the measured roofline (accounting/roofline/__init__.py): the aten operators
one step of generate()'s loop dispatches (the model's cached forward on the newest token of each
of `batch` sequences, attending to `context` cached positions, then the greedy choice of the next
token), recorded on fake tensors with roofline/trace.py's recorder, each priced at the decode roof
(decode_roof below: matmul rates at GEMV shapes, no-grad launch costs) and summed.

What a step reads: every weight matrix once (its matmul's bytes), the rows of the embedding it
gathers, and of every layer the keys and values of context + 1 positions (the cached ones and the
new token's, stored first: KVCache.update), 2 x layers x kv_heads x head_dim x (context + 1) x
itemsize x batch bytes. Attention FLOPs are counted for the query length against those keys
(4 x batch x heads x 1 x (context + 1) x head_dim): ops counts a training step's
attention as s x s, which a single query is not.

The roof a decode step runs on (`decode_roof`: accounting/roofline/__init__.py's Roof, adjusted): a decode step
multiplies `batch` rows (1 to a few) by each weight matrix, far below the training grid's smallest
M of 64, and runs under torch.no_grad through the model's modules, one small kernel after another.

Two more things are measured (about two seconds, cached as the roof is: accounting/hardware.py's
cache, `--remeasure` replaces it):
- matmul FLOP/s at GEMV-like shapes: M in GEMV_ROWS by every (N, K) of the training grid's
  (measure.MATMUL_DIMS), so that with the training grid they form one regular grid in M
  (interpolated in log2 M as any other dimension: roofline.interpolate), each call reading its
  weights from memory (measure.measure_matmuls with cold_megabytes);
- the fixed cost of one operator of a decode step: the step of a model so small that none of its
  operators does measurable work (one layer, width 16, vocabulary 32, 16 cached positions), timed
  and divided by the aten operators it dispatches as roofline/trace.py counts them. This is what a
  call costs in this code's decode path: the module calls, the Python between operators and the
  composite operators above the recorded ones (F.linear above t, mm, view) are paid per operator,
  which a chain of adds (the training roof's launch cost) does not pay. Views are counted alike.

`decode_roof(roof, measured)` is `roof` with the grid extended downward and that launch cost;
everything else (bandwidth, elementwise rates) is the same machine's.
"""

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lmforge.accounting.hardware import _measured, device_name
from lmforge.accounting.roofline import Roof, predict
from lmforge.accounting.roofline.measure import MINIMAL, _best_rate, measure_matmuls
from lmforge.accounting.roofline.ops import ATTENTION_FORWARD, Op, op_of, records_written, roof_after_writes
from lmforge.accounting.roofline.trace import dispatched_calls, recorded
from lmforge.config import ModelConfig
from lmforge.model.transformer import Transformer

# what generate() holds (the parameters' dtype: its cache is in the same) by inference weight format
TRACED_WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def record_decode(decoder, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype = torch.float32,
                  fake: bool = True) -> tuple:
    """The records (trace.Record) of one decode step at `context` cached positions, cached
    by its arguments; `fake=False` runs it on real tensors (what the tests compare the fake run with).
    `decoder(model, batch, context)` is the generate/ decoder's step, handed down by the caller
    (cli/plan_command.py's decode_step): its KV cache for `batch` sequences and a function that runs
    one step of its loop (the cached forward on the newest token, then the greedy choice)."""
    key = (decoder, repr(cfg), batch, context, dtype)
    if not fake:
        return _record(decoder, cfg, batch, context, dtype, fake)
    if key not in _TRACES:
        _TRACES[key] = _record(decoder, cfg, batch, context, dtype, fake)
    return _TRACES[key]


_TRACES: dict = {}


def _record(decoder, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, fake: bool) -> tuple:
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, context + 1), dropout=0.0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype`, as .to(dtype) would leave it (a fake tensor cannot be swapped)
    try:
        with mode:
            model = Transformer(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with mode:
        step = decoder(model, batch, context)
    # the recorder entered after (above) the fake mode, as trace.trace_step enters it
    with torch.no_grad(), mode:
        return recorded(step)


def decode_op(record) -> Op:
    """ops.op_of, with a single query's attention FLOPs against the cached keys."""
    op = op_of(record)
    if record.op in ATTENTION_FORWARD:
        (b, h, q, d), kv = record.inputs[0][0], record.inputs[1][0][2]
        op = dataclasses.replace(op, flops=4.0 * b * h * q * kv * d, shape=(kv, d))
    return op


def predict_decode(decoder, cfg: ModelConfig, batch: int, context: int, roof, weights: str = "fp32") -> dict | None:
    """roofline.predict of one decode step (tokens: `batch`), on `roof` (decode_roof's)
    with its elementwise rates those after the step's own writes, as a training step's are
    (ops.step_roof: a decode step writes a few hundred kB, so its activations stay in a
    core's caches), or None for a weight format lmforge does not run (int8, int4: no quantised kernels)."""
    if weights not in TRACED_WEIGHTS:
        return None
    records = record_decode(decoder, cfg, batch, context, TRACED_WEIGHTS[weights])
    result = predict(roof_after_writes(roof, records_written(records)), [decode_op(r) for r in records], batch)
    result["overlap"] = "none (eager: one kernel at a time)"
    return {**result, "batch": batch, "context": context, "weights": weights}


def untraced(plan: dict) -> str | None:
    """Why an inference plan's decode step is not traced (plan/inference.py's setup), or None."""
    st = plan["setup"]
    if st["tp"] > 1:
        return "tensor parallelism is not traced"
    if st["weights"] not in TRACED_WEIGHTS:
        return f"{st['weights']} weights: lmforge has no quantised kernels to trace"
    if st["kv_dtype"] != st["weights"]:
        return (f"lmforge's KV cache is in the weights' dtype ({st['weights']}), not {st['kv_dtype']}: "
                f"--kv-dtype {st['weights']} traces it")
    return None


def plan_decode(decoder, cfg: ModelConfig, plan: dict, roof) -> dict:
    """An inference plan's decode step by the roofline (its setup's batch, context = seq_len
    positions attended, weights), or {"none": why} where the trace does not cover it."""
    why = untraced(plan)
    if why:
        return {"none": why}
    st = plan["setup"]
    return predict_decode(decoder, cfg, st["batch_size"], st["seq_len"] - 1, roof, st["weights"])


# -- the decode roof ------------------------------------------------------------------------------
GEMV_ROWS = (1, 8)  # rows of a decode step's matmuls: batch 1 and batch 8
MINIMAL_CONTEXT = 16


@torch.no_grad()
def measure_decode_call(decoder, device: torch.device) -> float:
    """Seconds per dispatched operator of MINIMAL's decode step (model forward and greedy choice:
    `decoder`, as record_decode takes it)."""
    step = decoder(Transformer(MINIMAL).to(device).eval(), 1, MINIMAL_CONTEXT)
    return 1 / _best_rate(step, dispatched_calls(step), device, runs=3, seconds=0.05)


def measure_decode(decoder, device: torch.device) -> dict:
    """The decode roof's measurements as a JSON-ready dict, the global RNG left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return {"gemv": measure_matmuls(device, GEMV_ROWS, cold_megabytes=128),
                "call_seconds": measure_decode_call(decoder, device)}


def this_decode_measurements(decoder, device: torch.device, remeasure: bool = False, store: bool = True) -> dict:
    """measure_decode's result for this machine, from the cache unless `remeasure`."""
    key = f"roofline decode v2|{device_name(device)}|torch {torch.__version__}"
    return _measured(key, "decode", lambda: measure_decode(decoder, device), remeasure, store)


def decode_roof(roof: Roof, measured: dict | None) -> Roof:
    """`roof` for a decode step: the GEMV rows added to each dtype's matmul grid (where their N and
    K are the grid's), the decode path's cost per operator for calls and views alike; `measured`
    None (a datasheet roof): `roof` itself."""
    if not measured:
        return roof
    matmul = {}
    for dtype, rows in roof.matmul.items():
        extra = measured["gemv"].get(dtype, [])
        same_axes = {tuple(r[1:3]) for r in extra} == {tuple(r[1:3]) for r in rows}
        smallest = min(r[0] for r in rows)
        matmul[dtype] = rows + [r for r in extra if r[0] < smallest] if same_axes else rows
    return dataclasses.replace(roof, matmul=matmul, call_seconds=measured["call_seconds"],
                               view_call_seconds=measured["call_seconds"], name=f"{roof.name} (decode)")
