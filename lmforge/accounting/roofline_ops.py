"""The operations of one training step, each with its FLOPs and the bytes it moves, for the
roofline (roofline.py). Read from the model built on the meta device (shapes.py's meta_model):
every linear layer's (M, N, K), so the list follows the model as flops.py does.

Per micro-batch of M = b*s tokens, for a linear layer of K inputs and N outputs (compute dtype of
c bytes): forward x W^T is (M, N, K); backward dX = dY W is (M, K, N) and dW = dY^T X is (N, K, M);
each 2*M*N*K FLOPs and moves its three tensors once. Under autocast each forward casts its input
and its weight to 16 bits and each backward casts both gradients back. The attention core is one
fused kernel (sdpa) forward and one backward, counted as flops.py counts it (the full s x s).
Elementwise ops (norms, rotary, SwiGLU, residual adds, the gradient sums where a tensor feeds
several layers) move the tensors they read and write, counted from the tensors' sizes; their few
FLOPs are not counted (flops.py counts matmul FLOPs only, and they are memory-bound). The loss is
log-softmax over the logits in fp32; AdamW (optim/adamw.py, foreach) reads and writes each
parameter, its gradient and its two moments in eight passes; clipping reads each gradient twice.
`calls` is the number of kernels an op launches in eager mode (an estimate per op, not counted
from a trace): each pays the measured launch cost.
"""

from dataclasses import dataclass, replace

from lmforge.accounting import comm
from lmforge.accounting.shapes import meta_model
from lmforge.config import ModelConfig
from lmforge.modes.parallel import get_strategy
from lmforge.modes.precision import Policy
from lmforge.modes.recompute import get_recompute


@dataclass(frozen=True)
class Op:
    name: str
    cls: str  # one of roofline.CLASSES
    kind: str  # the rate it runs at: matmul, sdpa_forward, sdpa_backward, elementwise, foreach, collective
    flops: float
    bytes: float
    shape: tuple = ()  # (M, N, K) of a matmul; (s, head_dim) of attention
    calls: int = 1
    dtype: str = "float32"


def _ew(name: str, nbytes: float, calls: int = 1, cls: str = "norms/elementwise", kind: str = "elementwise") -> Op:
    return Op(name, cls, kind, 0.0, float(nbytes), (), calls)


def linear_forward(name: str, m: int, k: int, n: int, policy: Policy) -> list[Op]:
    """x (m, k) @ W^T (k, n), and under autocast the casts of x and W to 16 bits before it."""
    c, p = policy.bytes.compute, policy.bytes.parameter
    ops = [Op(f"{name} forward", "matmuls", "matmul", 2 * m * n * k, c * (m * k + k * n + m * n), (m, n, k),
              1, policy.matmul_dtype)]
    if policy.autocast:
        ops.append(_ew(f"{name} casts", (policy.bytes.residual + c) * m * k + (p + c) * n * k, 2))
    return ops


def linear_backward(name: str, m: int, k: int, n: int, policy: Policy) -> list[Op]:
    """dX = dY W (m, k, n) and dW = dY^T X (n, k, m); under autocast both cast back."""
    c, dtype = policy.bytes.compute, policy.matmul_dtype
    moved = c * (m * k + k * n + m * n)
    ops = [Op(f"{name} backward dX", "matmuls", "matmul", 2 * m * n * k, moved, (m, k, n), 1, dtype),
           Op(f"{name} backward dW", "matmuls", "matmul", 2 * m * n * k, moved, (n, k, m), 1, dtype)]
    if policy.autocast:
        ops.append(_ew(f"{name} gradient casts", (c + policy.bytes.residual) * m * k
                       + (c + policy.bytes.gradient) * n * k, 2))
    return ops


def _rope_bytes(elements: int, c: int) -> float:
    """apply_rope on a (b, h, s, d) tensor: neg of half, cat, two multiplies by the fp32 tables and
    an add (outputs promoted to fp32), and the cast back where c < 4."""
    wide = max(c, 4)
    return elements * (c + 2 * c + 2 * (c + wide) + 3 * wide + (wide + c if c < wide else 0))


def block_ops(cfg: ModelConfig, layer: str, b: int, s: int, policy: Policy, linears: dict) -> tuple[list, list]:
    """(forward, backward) ops of one block."""
    m, d, c, r = b * s, cfg.d_model, policy.bytes.compute, policy.bytes.residual
    q_elems, kv_elems = m * cfg.n_heads * cfg.head_dim, m * cfg.kv_heads * cfg.head_dim
    # SwiGLU's gate by model.mlp, the rotary by family (model.mlp=relu2 or gelu on llama has no gate_proj);
    # ReLU^2's elementwise work is counted as GELU's (one read, one write each way)
    gated, rotary = cfg.mlp_kind == "swiglu", cfg.family == "llama"
    norm_fwd, norm_bwd = _ew(f"{layer} norm forward", 2 * r * m * d), _ew(f"{layer} norm backward", 4 * r * m * d, 4)
    residual_fwd = _ew(f"{layer} residual add", (2 * r + c) * m * d)
    residual_bwd = _ew(f"{layer} residual gradient", 3 * r * m * d + ((r + c) * m * d if c != r else 0))
    forward, backward = [norm_fwd], []
    attn = ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    mlp = ["mlp.gate_proj", "mlp.up_proj"] if gated else ["mlp.up_proj"]
    for name in attn:
        forward += linear_forward(f"{layer}.{name}", m, *linears[f"{layer}.{name}"], policy)
    attention_fwd = Op(f"{layer} attention forward", "attention", "sdpa_forward",
                       4 * b * cfg.n_heads * s * s * cfg.head_dim, c * (2 * q_elems + 2 * kv_elems) + 4 * m * cfg.n_heads,
                       (s, cfg.head_dim), 1, policy.matmul_dtype)
    attention_bwd = Op(f"{layer} attention backward", "attention", "sdpa_backward", 2 * attention_fwd.flops,
                       c * (4 * q_elems + 4 * kv_elems), (s, cfg.head_dim), 2, policy.matmul_dtype)
    if rotary:
        forward.append(_ew(f"{layer} rotary", _rope_bytes(q_elems + kv_elems, c), 12))
    forward += [attention_fwd, _ew(f"{layer} attention output layout", 2 * c * q_elems)]
    forward += linear_forward(f"{layer}.attn.o_proj", m, *linears[f"{layer}.attn.o_proj"], policy)
    forward += [residual_fwd, norm_fwd]
    for name in mlp:
        forward += linear_forward(f"{layer}.{name}", m, *linears[f"{layer}.{name}"], policy)
    f = cfg.ffn_dim
    forward.append(_ew(f"{layer} {cfg.mlp_kind}", (5 if gated else 2) * c * m * f, 2 if gated else 1))
    forward += linear_forward(f"{layer}.mlp.down_proj", m, *linears[f"{layer}.mlp.down_proj"], policy)
    forward.append(residual_fwd)
    # backward, in reverse
    backward += [residual_bwd] + linear_backward(f"{layer}.mlp.down_proj", m, *linears[f"{layer}.mlp.down_proj"], policy)
    backward.append(_ew(f"{layer} {cfg.mlp_kind} backward", (9 if gated else 3) * c * m * f, 3 if gated else 1))
    for name in mlp:
        backward += linear_backward(f"{layer}.{name}", m, *linears[f"{layer}.{name}"], policy)
    if gated:  # gate and up read the same normalised input: their input gradients are summed
        backward.append(_ew(f"{layer} mlp input gradient sum", 3 * r * m * d))
    backward += [norm_bwd, residual_bwd]
    backward += linear_backward(f"{layer}.attn.o_proj", m, *linears[f"{layer}.attn.o_proj"], policy)
    backward += [_ew(f"{layer} attention output layout backward", 2 * c * q_elems), attention_bwd]
    if rotary:
        backward.append(_ew(f"{layer} rotary backward", _rope_bytes(q_elems + kv_elems, c), 12))
    for name in attn:
        backward += linear_backward(f"{layer}.{name}", m, *linears[f"{layer}.{name}"], policy)
    backward += [_ew(f"{layer} qkv input gradient sums", 2 * 3 * r * m * d, 2), norm_bwd]
    return forward, backward


def _linear_shapes(cfg: ModelConfig) -> dict:
    """(K in_features, N out_features) of every linear layer, by its full name."""
    import torch.nn as nn

    return {name: (module.in_features, module.out_features) for name, module in meta_model(cfg).named_modules()
            if isinstance(module, nn.Linear)}


def micro_batch_ops(cfg: ModelConfig, b: int, s: int, policy: Policy, recompute: str = "none") -> list[Op]:
    """Forward and backward of one micro-batch (recomputation's extra forward included)."""
    m, d, v, r, c = b * s, cfg.d_model, cfg.vocab_size, policy.bytes.residual, policy.bytes.compute
    g = policy.bytes.gradient
    linears, mode = _linear_shapes(cfg), get_recompute(recompute)
    embed = [_ew("embedding lookup", 2 * r * m * d)]
    if cfg.family == "gpt":
        embed.append(_ew("position embedding add", 3 * r * m * d))
    forward, backward = list(embed), []
    for layer in range(cfg.n_layers):
        fwd, bwd = block_ops(cfg, f"blocks.{layer}", b, s, policy, linears)
        forward += fwd
        again = [op for op in fwd if op.cls == "attention"] if mode.attention_cores else []
        if mode.blocks:  # torch.utils.checkpoint stops once backward has what it needs: before down_proj
            again = fwd[:next(i for i, op in enumerate(fwd) if op.name.endswith("down_proj forward"))]
        backward = [replace(op, name=f"{op.name} (recomputed)") for op in again] + bwd + backward
    head_fwd = [_ew("final norm forward", 2 * r * m * d)] + linear_forward("lm_head", m, d, v, policy)
    wide = 4
    loss_fwd = _ew("cross-entropy forward", ((c + wide) if c < wide else 0) * m * v + 2 * wide * m * v, 3, "loss")
    loss_bwd = _ew("cross-entropy backward", 4 * wide * m * v + ((wide + c) if c < wide else 0) * m * v, 4, "loss")
    head_bwd = linear_backward("lm_head", m, d, v, policy) + [_ew("final norm backward", 4 * r * m * d, 4)]
    embed_bwd = [_ew("embedding backward", g * (v * d + 2 * m * d), 2)]
    if cfg.tie_embeddings:
        embed_bwd.append(_ew("tied embedding gradient sum", 3 * g * v * d))
    return forward + head_fwd + [loss_fwd, loss_bwd] + head_bwd + backward + embed_bwd


def optimizer_ops(parameter_shapes: tuple, policy: Policy, shards: int = 1, clip: bool = True) -> list[Op]:
    """AdamW's foreach step over this rank's share of the parameters (ZeRO: 1/shards of each), and
    global-norm clipping. Per element: weight decay r/w the parameter; lerp_ r/w m, reads g; mul_
    r/w v; addcmul_ r/w v, reads g; sqrt, div_, add_ on the denominators; addcdiv_ r/w the
    parameter, reads m and the denominator: 4 parameter, 14 state and 2 gradient accesses."""
    p, sb, g = policy.bytes.parameter, policy.bytes.optimizer_state, policy.bytes.gradient
    master = policy.bytes.master
    elements = sum(_numel(shape) for shape in parameter_shapes) / shards
    tensors = len(parameter_shapes)
    ops = [Op("AdamW update", "optimizer", "foreach", 0.0, elements * (4 * (master or p) + 14 * sb + 2 * g),
              (), 9 * tensors)]
    if master:
        ops.append(_ew("master weights to parameters", elements * (master + p), tensors, "optimizer"))
    if clip:
        ops.append(_ew("gradient clipping", 3 * g * elements, 2 * tensors + 3, "optimizer"))
    return ops


def _numel(shape: tuple) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def step_ops(cfg: ModelConfig, setup, parameter_shapes: tuple, strategy: str) -> list[Op]:
    """Every op of one optimizer step on one rank of `setup` (plan/make.py's Setup): grad_accum
    micro-batches, the optimizer on this rank's shard, the collectives of `strategy` (comm.py's bytes)."""
    policy = setup.policy
    ops = micro_batch_ops(cfg, setup.batch_size, setup.seq_len, policy, setup.recompute) * setup.grad_accum
    if setup.grad_accum > 1:  # micro-steps after the first add into the kept gradients
        elements = sum(_numel(shape) for shape in parameter_shapes)
        ops.append(_ew("gradient accumulation", 3 * policy.bytes.gradient * elements * (setup.grad_accum - 1),
                       len(parameter_shapes) * (setup.grad_accum - 1)))
    shards = setup.dp if get_strategy(strategy).zero_stage >= 1 else 1
    ops += optimizer_ops(parameter_shapes, policy, shards)
    sent = comm.step_communication(cfg, strategy, setup.dp, policy, setup.grad_accum)
    if sent["sent_bytes"]:
        units = len(comm.unit_sizes(cfg))
        collectives = units * (1 if strategy == "ddp" else 2 if get_strategy(strategy).zero_stage < 3 else 3)
        ops.append(Op(f"{strategy} collectives", "communication", "collective", 0.0, sent["sent_bytes"], (),
                      collectives))
    return ops



def predict_step(cfg: ModelConfig, setup, roof, strategy: str) -> dict | None:
    """The roofline's prediction of one optimizer step of `setup` on `roof` (roofline.predict), or
    None where the op list does not cover the setup yet (tensor or pipeline parallelism, LoRA)."""
    from lmforge.accounting.roofline import predict
    from lmforge.accounting.shapes import model_shapes

    if setup.tp > 1 or setup.pp > 1 or setup.lora_rank is not None:
        return None
    ops = step_ops(cfg, setup, model_shapes(cfg).parameter_shapes, strategy)
    return predict(roof, ops, setup.tokens_per_step)
