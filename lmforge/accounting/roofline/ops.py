"""The operations of one training step, each with its FLOPs and the bytes it moves, for the
roofline (roofline.py): the aten operators the step really dispatches (roofline/trace.py: the
model run on fake tensors of the real shapes), one Op per operator call.

- class: mm/addmm are the matmuls; the fused attention kernels (and the naive backend's bmm) the
  attention; log-softmax, NLL and whatever the loss module runs itself the loss; everything run by
  clipping and the optimizer step the optimizer; the rest norms/elementwise.
- FLOPs: 2*M*N*K per matmul (bmm: per batch); attention as shapes.py counts it (4*b*h*s^2*d
  forward, the full s x s, twice that backward); other operators' few FLOPs are not counted (they
  are memory-bound: their bytes decide their time).
- bytes: every tensor argument and result once (an in-place op reads and writes its tensor),
  counting an expanded dimension (stride 0) once; a view or reshape moves none; an embedding
  lookup reads the rows it gathers, not the whole table.
- calls: one kernel per operator call, one per tensor of a foreach op (the CPU loops over them).
"""

import dataclasses
import math
from dataclasses import dataclass

from lmforge.accounting import comm
from lmforge.accounting.roofline import ITEMSIZE, predict, rate_dtype, rates_after
from lmforge.accounting.roofline.trace import Record, trace_step
from lmforge.accounting.shapes import model_shapes
from lmforge.config import Config, ModelConfig
from lmforge.modes import get_policy, get_strategy

MATMULS = ("mm", "addmm", "bmm", "baddbmm")
ATTENTION_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
LOSS = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")


@dataclass(frozen=True)
class Op:
    name: str
    cls: str  # one of roofline.CLASSES
    kind: str  # the rate it runs at: matmul, sdpa_forward, sdpa_backward, elementwise, foreach, view, collective
    flops: float
    bytes: float
    shape: tuple = ()  # (M, N, K) of a matmul; (s, head_dim) of attention
    calls: int = 1
    dtype: str = "float32"
    op: str = ""  # the aten operator: which measured elementwise rate applies (roofline.memory_rate)
    layout: str = ""  # an mm/addmm's operands: "n" as stored, "t" transposed (roofline.shape_key)


def _touched(meta: tuple) -> int:
    """Bytes of a tensor (shape, stride, dtype) as a kernel streams it: an expanded (stride 0)
    dimension is read once."""
    shape, stride, dtype = meta
    n = 1
    for size, step in zip(shape, stride):
        n *= size if step else 1
    return n * ITEMSIZE.get(dtype, 4)


def _matmul(r: Record) -> tuple[float, tuple]:
    """(FLOPs, (M, N, K)) of mm, addmm (bias first), bmm, baddbmm."""
    a, b = r.inputs[-2][0], r.inputs[-1][0]
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    return 2.0 * batch * m * n * k, (batch * m, n, k)


def _layout(r: Record) -> str:
    """An mm or addmm's operand layouts, "n" (rows contiguous) or "t" (a transposed view: columns
    contiguous) each, e.g. "nt" for F.linear's x @ W.T; "" for a batched matmul."""
    if r.op not in ("mm", "addmm"):
        return ""
    return "".join("n" if stride[-1] == 1 else "t" for _, stride, _ in r.inputs[-2:])


def op_of(r: Record) -> Op:
    """The roofline's Op for one traced operator call."""
    dtype = r.inputs[0][2] if r.inputs else "float32"
    name = f"{r.module or 'step'} {r.op}"
    if r.is_view:
        return Op(name, "optimizer" if r.phase == "optimizer" else "norms/elementwise", "view", 0.0, 0.0, (), 1,
                  dtype, r.op)
    nbytes = float(sum(_touched(t) for t in r.inputs + r.outputs))
    if r.op.endswith("_") and not r.outputs:  # an in-place foreach op returns nothing: it writes its first list
        nbytes += sum(_touched(t) for t in r.inputs[:r.calls])
    if r.op == "embedding":  # reads the gathered rows (as many bytes as it writes) and the indices
        nbytes = float(2 * _touched(r.outputs[0]) + _touched(r.inputs[1]))
    if r.phase == "optimizer":
        return Op(name, "optimizer", "foreach" if r.op.startswith("_foreach") else "elementwise", 0.0, nbytes,
                  (), r.calls, dtype, r.op)
    if r.op in MATMULS:
        flops, shape = _matmul(r)
        return Op(name, "attention" if r.op.startswith(("bmm", "baddbmm")) else "matmuls", "matmul", flops,
                  nbytes, shape, 1, dtype, r.op, layout=_layout(r))
    backward = r.op.endswith("_backward")
    if r.op.removesuffix("_backward") in ATTENTION_FORWARD:
        b, h, s, d = r.inputs[1 if backward else 0][0]  # backward's first argument is the output gradient
        flops = 4.0 * b * h * s * s * d * (2 if backward else 1)
        return Op(name, "attention", "sdpa_backward" if backward else "sdpa_forward", flops, nbytes, (s, d), 1,
                  dtype, r.op)
    loss = r.op in LOSS or r.module.endswith(".loss")
    return Op(name, "loss" if loss else "norms/elementwise", "elementwise", 0.0, nbytes, (), 1, dtype, r.op)


def layer_extrapolated(cfg: ModelConfig, ops_of) -> list[Op]:
    """`ops_of(cfg)` for a model of any depth from traces of 2 and 3 layers: the blocks are
    identical, so past the second every total of every kind of op (FLOPs, bytes, kernels, per
    name, class, shape and dtype) grows by the same amount with each layer, and a 2-layer trace
    plus (L - 2) times the third layer's increment is the L-layer trace's (a 1-layer model is not
    on the line: its one block is first and last, and its input gradient is never summed into a
    residual). tests/test_roofline.py checks it against a direct trace. A trace costs time in
    proportion to its operators, so a 70B plan costs what a 3-layer one does. Ops alike in all that
    decides their time come back merged, totals summed (op_time is linear in them)."""
    if cfg.n_layers <= 3:
        return ops_of(cfg)
    totals = []
    for layers in (2, 3):
        by_key: dict = {}
        for op in ops_of(dataclasses.replace(cfg, n_layers=layers)):
            # by what decides its time, not by module (backward ops are not reliably attributed to
            # one): class, rate, shape, dtype, operator and bytes per kernel (a foreach op's lists
            # and the optimizer's stacked norms grow with the layers: one key each)
            size = None if op.cls == "optimizer" else op.bytes / max(op.calls, 1)
            key = (op.cls, op.kind, op.shape, op.dtype, op.op, size, op.layout)
            flops, moved, calls = by_key.get(key, (0.0, 0.0, 0))
            by_key[key] = (flops + op.flops, moved + op.bytes, calls + op.calls)
        totals.append(by_key)
    one, two = totals
    more = cfg.n_layers - 2
    ops = []
    for key in dict.fromkeys([*one, *two]):
        a, b = one.get(key, (0.0, 0.0, 0)), two.get(key, (0.0, 0.0, 0))
        flops, moved, calls = (x + more * (y - x) for x, y in zip(a, b))
        if calls > 0 or flops > 0 or moved > 0:
            cls, kind, shape, dtype, aten, _, layout = key
            ops.append(Op(f"{aten} x {int(round(calls))} (every layer)", cls, kind, flops, moved, shape,
                          int(round(calls)), dtype, aten, layout=layout))
    return ops


def micro_batch_ops(build, cfg: ModelConfig, b: int, s: int, precision: str = "fp32", recompute: str = "none",
                    loss_chunk_tokens: int = 0, fp32_attention: bool = False) -> list[Op]:
    """Forward and backward of one micro-batch, recomputation's extra forward included (`build`:
    the trainer's one-process engine, as trace.trace_step takes it)."""
    def ops_of(c: ModelConfig) -> list[Op]:
        records = trace_step(build, c, b, s, precision, recompute, "adamw", loss_chunk_tokens, fp32_attention)
        return [op_of(r) for r in records if r.phase == "step"]

    return layer_extrapolated(cfg, ops_of)


def optimizer_ops(build, cfg: ModelConfig, b: int, s: int, precision: str = "fp32", optimizer: str = "adamw",
                  shards: int = 1) -> list[Op]:
    """Gradient clipping and the optimizer's step over this rank's share of the parameters (ZeRO:
    1/shards of each tensor's bytes; the kernels are as many)."""
    def ops_of(c: ModelConfig) -> list[Op]:
        return [op_of(r) for r in trace_step(build, c, b, s, precision, "none", optimizer) if r.phase == "optimizer"]

    ops = layer_extrapolated(cfg, ops_of)
    return [dataclasses.replace(o, bytes=o.bytes / shards) for o in ops]


def step_ops(build, run: Config, dp: int, strategy: str) -> list[Op]:
    """Every op of one optimizer step on one of `dp` data-parallel ranks of `run`: grad_accum micro-batches
    (those after the first add into the kept gradients: the trace's backward accumulates into none), the
    optimizer on this rank's shard, the collectives of `strategy` (comm.py's bytes). `build`: trace_step's."""
    cfg, t, p = run.model, run.train, get_policy(run.train.precision)
    ops = micro_batch_ops(build, cfg, t.batch_size, run.seq_len, p.name, t.recompute, t.loss_chunk_tokens,
                          t.fp32_attention) * t.grad_accum
    if t.grad_accum > 1:
        shapes = model_shapes(cfg).parameter_shapes
        elements = sum(math.prod(shape) for shape in shapes)
        ops.append(Op("gradient accumulation", "norms/elementwise", "elementwise", 0.0,
                      3.0 * p.bytes.gradient * elements * (t.grad_accum - 1), (),
                      len(shapes) * (t.grad_accum - 1), p.param_dtype, "add_"))
    shards = dp if get_strategy(strategy).zero_stage >= 1 else 1
    ops += optimizer_ops(build, cfg, t.batch_size, run.seq_len, p.name, run.optim.name, shards)
    return ops + collective_ops(run, dp, strategy)


def collective_ops(run: Config, dp: int, strategy: str) -> list[Op]:
    """One Op per collective operator a rank calls in a step of `strategy` (comm.step_collectives),
    its calls and the bytes it sends (comm.step_communication's, by operator; a scalar's none, a
    Muon gather's with the all-gathers), priced at that operator's measured latency and bandwidth."""
    cfg, t, p = run.model, run.train, get_policy(run.train.precision)
    sent = comm.step_communication(cfg, strategy, dp, p, t.grad_accum, optimizer=run.optim.name)
    per_element = sent["element_bytes"] * (dp - 1) / dp
    ops = []
    for name, calls in comm.step_collectives(cfg, strategy, dp, p, t.grad_accum, t.bucket_mb).items():
        operator = "all_reduce" if name == "scalar_all_reduce" else name
        nbytes = sent["ring_elements_by_op"].get(name, 0) * per_element
        if name == "all_gather":
            nbytes += sent["optimizer_sent_bytes"]
        ops.append(Op(f"{strategy} {name.replace('_', ' ')}", "communication", "collective", 0.0, float(nbytes), (),
                      calls, op=operator))
    return ops


def traced(run: Config) -> bool:
    """Whether the trace covers `run` (not yet: tensor, context or pipeline parallelism, LoRA, fp8)."""
    return not (run.parallel.tp * run.parallel.cp * run.parallel.pp > 1 or run.finetune.lora_rank
                is not None or get_policy(run.train.precision).fp8)


def predict_step(build, run: Config, dp: int, roof, strategy: str) -> dict | None:
    """The roofline's prediction of one optimizer step of `run` on one of `dp` data-parallel ranks on
    `roof` (roofline.predict), or None where the trace does not cover the run yet (traced)."""
    if not traced(run):
        return None
    tokens = run.train.batch_size * run.seq_len * run.train.grad_accum * dp  # one stage: no micro-batches
    return predict(step_roof(build, run, dp, roof), step_ops(build, run, dp, strategy), tokens)


def step_matmul_shapes(build, run: Config) -> tuple:
    """((dtype, operator, M, N, K, layout), ...): the distinct mm/addmm calls of one micro-batch's forward and
    backward, in the dtype whose rates price them (roofline.rate_dtype), for shapes.py to time alone (or ())."""
    t = run.train
    ops = micro_batch_ops(build, run.model, t.batch_size, run.seq_len, get_policy(t.precision).name, t.recompute,
                          t.loss_chunk_tokens, t.fp32_attention) if traced(run) else []
    return tuple(dict.fromkeys((rate_dtype(op.dtype), op.op, *op.shape, op.layout) for op in ops if op.layout))


def step_roof(build, run: Config, dp: int, roof):
    """`roof` with its elementwise rates those measured after as many bytes of other writes as the
    step writes (roofline.rates_after): an operand of a step was last touched up to a step's writes
    before (the optimizer's states, the weights and their gradients a whole step; what the forward
    saves, the rest of the forward and part of the backward). A step writing far more than the
    cache (small: 1.2 GB) reads the cold rates, one writing little nearly the warm ones. Where the
    cache is shared (a CPU's last level), the data-parallel ranks on the machine write into it at
    once: a step's writes are theirs all. A roof without that grid (a datasheet's) keeps its rates."""
    return roof_after_writes(roof, step_writes(build, run, dp, roof))


def step_writes(build, run: Config, dp: int, roof) -> float:
    """Bytes written into the cache an operand of a step waits in between its uses: the step's
    (written_bytes), times the data-parallel ranks where the cache is shared (a CPU's last level)."""
    return written_bytes(build, run) * (dp if roof.cache_shared else 1)


def roof_after_writes(roof, written: float):
    """`roof` with its elementwise rates read after `written` bytes of other writes
    (roofline.rates_after); a roof without that grid (a datasheet's) as it is."""
    if not roof.elementwise_ops_after:
        return roof
    return dataclasses.replace(roof, elementwise_ops=rates_after(roof, written))


def records_written(records) -> float:
    """Bytes of every non-view result among the trace's `records`: what they write."""
    return float(sum(_touched(t) for r in records if not r.is_view for t in r.outputs))


def written_bytes(build, run: Config) -> float:
    """Bytes of the tensors one micro-batch's forward + backward and the optimizer step write
    (every traced non-view result; linear in the layers past the second, as layer_extrapolated's
    totals are)."""
    cfg, t = run.model, run.train

    def of(layers: int) -> float:
        c = dataclasses.replace(cfg, n_layers=layers)
        # micro_batch_ops's trace (cached), its AdamW step standing in for the optimizer's writes
        records = trace_step(build, c, t.batch_size, run.seq_len, get_policy(t.precision).name, t.recompute,
                             "adamw", t.loss_chunk_tokens, t.fp32_attention)
        return records_written(records)

    if cfg.n_layers <= 3:
        return of(cfg.n_layers)
    two, three = of(2), of(3)
    return two + (cfg.n_layers - 2) * (three - two)
