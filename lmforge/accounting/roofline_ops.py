"""The operations of one training step, each with its FLOPs and the bytes it moves, for the
roofline (roofline.py): the aten operators the step really dispatches (roofline_trace.py: the
model run on fake tensors of the real shapes), one Op per operator call.

- class: mm/addmm are the matmuls; the fused attention kernels (and the naive backend's bmm) the
  attention; log-softmax, NLL and whatever the loss module runs itself the loss; everything run by
  clipping and the optimizer step the optimizer; the rest norms/elementwise.
- FLOPs: 2*M*N*K per matmul (bmm: per batch); attention as flops.py counts it (4*b*h*s^2*d
  forward, the full s x s, twice that backward); other operators' few FLOPs are not counted (they
  are memory-bound: their bytes decide their time).
- bytes: every tensor argument and result once (an in-place op reads and writes its tensor),
  counting an expanded dimension (stride 0) once; a view or reshape moves none; an embedding
  lookup reads the rows it gathers, not the whole table.
- calls: one kernel per operator call, one per tensor of a foreach op (the CPU loops over them).
"""

from dataclasses import dataclass

from lmforge.accounting import comm
from lmforge.accounting.roofline_trace import Record, trace_step
from lmforge.config import ModelConfig
from lmforge.modes.parallel import get_strategy

ITEMSIZE = {"float64": 8, "float32": 4, "int64": 8, "int32": 4, "bfloat16": 2, "float16": 2, "bool": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}
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
                  nbytes, shape, 1, dtype, r.op)
    backward = r.op.endswith("_backward")
    if r.op.removesuffix("_backward") in ATTENTION_FORWARD:
        b, h, s, d = r.inputs[1 if backward else 0][0]  # backward's first argument is the output gradient
        flops = 4.0 * b * h * s * s * d * (2 if backward else 1)
        return Op(name, "attention", "sdpa_backward" if backward else "sdpa_forward", flops, nbytes, (s, d), 1,
                  dtype, r.op)
    loss = r.op in LOSS or r.module.endswith(".loss")
    return Op(name, "loss" if loss else "norms/elementwise", "elementwise", 0.0, nbytes, (), 1, dtype, r.op)


def micro_batch_ops(cfg: ModelConfig, b: int, s: int, precision: str = "fp32", recompute: str = "none",
                    loss_chunk_tokens: int = 0, fp32_attention: bool = False) -> list[Op]:
    """Forward and backward of one micro-batch, recomputation's extra forward included."""
    records = trace_step(cfg, b, s, precision, recompute, "adamw", loss_chunk_tokens, True, fp32_attention)
    return [op_of(r) for r in records if r.phase == "step"]


def optimizer_ops(cfg: ModelConfig, b: int, s: int, precision: str = "fp32", optimizer: str = "adamw",
                  shards: int = 1, clip: bool = True) -> list[Op]:
    """Gradient clipping and the optimizer's step over this rank's share of the parameters (ZeRO:
    1/shards of each tensor's bytes; the kernels are as many)."""
    records = trace_step(cfg, b, s, precision, "none", optimizer, 0, clip)
    ops = [op_of(r) for r in records if r.phase == "optimizer"]
    return [Op(o.name, o.cls, o.kind, o.flops, o.bytes / shards, o.shape, o.calls, o.dtype, o.op) for o in ops]


def step_ops(cfg: ModelConfig, setup, strategy: str) -> list[Op]:
    """Every op of one optimizer step on one rank of `setup` (plan/make.py's Setup): grad_accum
    micro-batches (those after the first add into the kept gradients: the trace's backward
    accumulates into none), the optimizer on this rank's shard, the collectives of `strategy`
    (comm.py's bytes)."""
    p = setup.policy
    ops = micro_batch_ops(cfg, setup.batch_size, setup.seq_len, p.name, setup.recompute, setup.loss_chunk_tokens,
                          setup.fp32_attention) * setup.grad_accum
    if setup.grad_accum > 1:
        from lmforge.accounting.shapes import model_shapes

        shapes = model_shapes(cfg).parameter_shapes
        elements = sum(_numel(shape) for shape in shapes)
        ops.append(Op("gradient accumulation", "norms/elementwise", "elementwise", 0.0,
                      3.0 * p.bytes.gradient * elements * (setup.grad_accum - 1), (),
                      len(shapes) * (setup.grad_accum - 1), p.param_dtype, "add_"))
    shards = setup.dp if get_strategy(strategy).zero_stage >= 1 else 1
    ops += optimizer_ops(cfg, setup.batch_size, setup.seq_len, p.name, setup.optimizer, shards)
    sent = comm.step_communication(cfg, strategy, setup.dp, p, setup.grad_accum)
    if sent["sent_bytes"]:
        units = len(comm.unit_sizes(cfg))
        collectives = units * (1 if strategy == "ddp" else 2 if get_strategy(strategy).zero_stage < 3 else 3)
        ops.append(Op(f"{strategy} collectives", "communication", "collective", 0.0, sent["sent_bytes"], (),
                      collectives))
    return ops


def _numel(shape: tuple) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def predict_step(cfg: ModelConfig, setup, roof, strategy: str) -> dict | None:
    """The roofline's prediction of one optimizer step of `setup` on `roof` (roofline.predict), or
    None where the trace does not cover the setup yet (tensor or pipeline parallelism, LoRA, fp8)."""
    from lmforge.accounting.roofline import predict

    if setup.tp > 1 or setup.pp > 1 or setup.lora_rank is not None or setup.policy.fp8:
        return None
    return predict(roof, step_ops(cfg, setup, strategy), setup.tokens_per_step)
