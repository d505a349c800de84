"""A decode step's time from the measured roofline (accounting/roofline/__init__.py): the aten operators
one step of generate()'s loop dispatches (the model's cached forward on the newest token of each
of `batch` sequences, attending to `context` cached positions, then the greedy choice of the next
token), recorded on fake tensors with roofline/trace.py's recorder, each priced at the decode roof
(accounting/roofline/decode_roof.py: matmul rates at GEMV shapes, no-grad launch costs) and summed.

What a step reads: every weight matrix once (its matmul's bytes), the rows of the embedding it
gathers, and of every layer the keys and values of context + 1 positions (the cached ones and the
new token's, stored first: KVCache.update), 2 x layers x kv_heads x head_dim x (context + 1) x
itemsize x batch bytes. Attention FLOPs are counted for the query length against those keys
(4 x batch x heads x 1 x (context + 1) x head_dim): ops counts a training step's
attention as s x s, which a single query is not.
"""

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lmforge.accounting.roofline import predict
from lmforge.accounting.roofline.ops import ATTENTION_FORWARD, Op, op_of, records_written, roof_after_writes
from lmforge.accounting.roofline.trace import recorded
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


def decode_ops(decoder, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype = torch.float32) -> list[Op]:
    return [decode_op(r) for r in record_decode(decoder, cfg, batch, context, dtype)]


def predict_decode(decoder, cfg: ModelConfig, batch: int, context: int, roof, weights: str = "fp32") -> dict | None:
    """roofline.predict of one decode step (tokens: `batch`), on `roof` (decode_roof.decode_roof's)
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
