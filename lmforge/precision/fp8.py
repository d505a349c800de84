"""FP8 linear layers with per-tensor scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning").

Two 8-bit formats, as the paper defines them:
    E4M3  4 exponent bits, 3 mantissa bits, max 448, no infinities: weights and activations (forward),
          which need precision more than range;
    E5M2  5 exponent bits, 2 mantissa bits, max 57344: gradients (backward), which need range.
Their dynamic range is far smaller than that of fp32 or bf16, so each tensor is multiplied by a
scale before the cast, chosen so that its largest magnitude (amax) lands near the format's max
(per-tensor scaling, as the paper recommends), and the matmul result is divided by the scales again:

    x_fp8 = saturate(x * s_x),   w_fp8 = saturate(w * s_w),   y = (x_fp8 @ w_fp8^T) / (s_x * s_w)

Values beyond the max saturate (clamp to +-max) instead of overflowing: the usual choice, and the
only sensible one for E4M3, which has no infinity. Scales here are powers of two (floor of log2(max / amax)): a power of
two multiplies exactly, so the only rounding is the cast itself, and an fp8 matmul simulated with
dequantised values gives the same numbers as a hardware fp8 matmul (checked against
`torch._scaled_mm` in tests/test_precision.py).

Scaling recipes:
    current  the scale comes from this tensor's own amax (a pass over it before the cast, exact);
    delayed  the scale comes from the largest amax recorded over the last `history` steps, and
             this step's amax is recorded for later (NVIDIA Transformer Engine's default: a fused
             kernel gets the amax out of the cast itself, no pass before it; a sudden growth
             saturates for a step). Here the amax is a separate pass either way: the point is the
             numerics, which are the same.

Where the hardware has fp8 matmul (CUDA compute capability 8.9 or newer: Ada, Hopper, Blackwell)
the matmul runs in `torch._scaled_mm`; elsewhere it is simulated: the fp8 values are converted
back to a wider dtype and multiplied there. Every fp8 value, and every product of two, is exact in
bf16/fp32, and the sum is accumulated in fp32 as the hardware does, so the simulation differs
from the hardware only in the order of the fp32 additions.
"""

import torch
import torch.nn as nn

from lmforge.common.errors import lookup
from lmforge.modes import FP8_SCALINGS

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
HISTORY = 16  # amax values delayed scaling keeps per operand


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_for(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The power-of-two scale s that maps `amax` to at most the format's max / 2**margin.

    amax 0 (an all-zero tensor) or non-finite amax gives scale 1: there is nothing to fit, or
    nothing sensible to fit to (a non-finite value saturates and the loss guard reports it)."""
    amax = amax.float()
    ok = torch.isfinite(amax) & (amax > 0)
    exponent = torch.floor(torch.log2(fp8_max(dtype) / torch.where(ok, amax, 1.0))) - margin
    # keep the scale itself a finite fp32 number for tensors of tiny magnitude
    exponent = exponent.clamp(-126, 126)
    return torch.where(ok, torch.exp2(exponent), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale cast to the fp8 `dtype`, saturating at +-max (not overflowing to NaN)."""
    limit = fp8_max(dtype)
    # bf16 and fp32 have the range to hold x * scale, and a power-of-two scale multiplies exactly;
    # fp16 could overflow (max 65504), so it goes through fp32
    wide = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return (x.to(wide) * scale.to(wide)).clamp_(-limit, limit).to(dtype)


def hardware_fp8(device: torch.device) -> bool:
    """True where `torch._scaled_mm` runs on fp8 tensor cores (CUDA, compute capability >= 8.9)."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, hardware: bool) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) for fp8 `a` (m, k) and `b` (k, n), accumulated in fp32 and
    rounded once to `out_dtype`."""
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()  # exact: powers of two
    if hardware and all(d % 16 == 0 for d in (*a.shape, b.shape[1])):
        # cuBLASLt wants the second operand column-major; the scales it takes are the dequantising ones
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                                out_dtype=out_dtype)
    # Simulation, the hardware's arithmetic step by step: multiply the fp8 values (every fp8 value,
    # and every product of two, is exact in bf16/fp32), accumulate in fp32, scale the accumulator.
    # The CPU's bf16 matmul accumulates in fp32, so for a bf16 result it is as faithful as fp32
    # and several times faster; scaling after the rounding to bf16 instead of before changes
    # nothing, the scales being powers of two.
    wide = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    out = a.to(wide) @ b.to(wide)
    return out.mul_((inv_a * inv_b).to(wide)).to(out_dtype)


class AmaxHistory:
    """Per-tensor scale state of one operand (input, weight or gradient) of one layer. `reduce`,
    where this process holds a slice of the operand (a tensor-parallel layer: parallel/tp_fp8.py),
    turns the slice's amax into the whole tensor's, in place (a max over the processes holding the
    slices), so that the scale is the one a single process computes."""

    def __init__(self, dtype: torch.dtype, scaling: str, length: int, reduce=None):
        lookup(FP8_SCALINGS, scaling, "fp8 scaling")
        self.dtype, self.scaling, self.length, self.reduce = dtype, scaling, length, reduce
        self.history: list[float] = []  # the last `length` amax values, newest last

    def scale(self, x: torch.Tensor, record: bool) -> torch.Tensor:
        amax = torch.linalg.vector_norm(x.detach(), ord=float("inf")).float()  # max |x|, one pass
        if self.reduce is not None:
            self.reduce(amax)
        if self.scaling == "delayed" and self.history:
            scale = scale_for(torch.tensor(max(self.history), device=x.device), self.dtype)
        else:  # current scaling, or the first step of delayed scaling (no history yet)
            scale = scale_for(amax, self.dtype)
        if record and self.scaling == "delayed":
            self.history = (self.history + [amax.item()])[-self.length:]
        return scale


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x @ w^T + b with x, w in E4M3 (forward) and dy in E5M2 (backward).

    Saved for backward: the fp8 copies of x and w (1 byte per element) and their scales, not the
    higher-precision x: this is where fp8 saves activation memory."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: "Fp8Scales", out_dtype: torch.dtype, record: bool):
        hardware = hardware_fp8(x.device)
        x2 = x.reshape(-1, x.shape[-1])
        sx, sw = layer.amax_x.scale(x2, record), layer.amax_w.scale(weight, record)
        x_fp8, w_fp8 = quantize(x2, sx, E4M3), quantize(weight, sw, E4M3)
        y = fp8_matmul(x_fp8, sx, w_fp8.t(), sw, out_dtype, hardware)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x_fp8, w_fp8, sx, sw)
        ctx.layer, ctx.hardware, ctx.x_shape, ctx.x_dtype = layer, hardware, x.shape, x.dtype
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, w_fp8, sx, sw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        sg = ctx.layer.amax_grad.scale(g2, record=True)
        g_fp8 = quantize(g2, sg, E5M2)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # dx = dy @ w
            grad_x = fp8_matmul(g_fp8, sg, w_fp8, sw, ctx.x_dtype, ctx.hardware).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # dw = dy^T @ x, in the master weight's dtype
            grad_w = fp8_matmul(g_fp8.t(), sg, x_fp8, sx, ctx.weight_dtype, ctx.hardware)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(ctx.weight_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class Fp8Scales:
    """The amax histories of a layer whose matmul runs in fp8 (input, weight, gradient), and their
    state for checkpoints (delayed scaling). `reduce` maps an operand name to its amax reduction
    (AmaxHistory), for the operands this process holds a slice of."""

    def init_scales(self, scaling: str, history: int, reduce: dict | None = None) -> None:
        reduce = reduce or {}
        self.amax_x = AmaxHistory(E4M3, scaling, history, reduce.get("x"))
        self.amax_w = AmaxHistory(E4M3, scaling, history, reduce.get("w"))
        self.amax_grad = AmaxHistory(E5M2, scaling, history, reduce.get("grad"))

    def scale_state(self) -> dict[str, list[float]]:
        return {"x": self.amax_x.history, "w": self.amax_w.history, "grad": self.amax_grad.history}

    def load_scale_state(self, state: dict[str, list[float]]) -> None:
        self.amax_x.history, self.amax_w.history = list(state["x"]), list(state["w"])
        self.amax_grad.history = list(state["grad"])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Fp8Scales) -> torch.Tensor:
    """x @ weight^T + bias with the matmuls in fp8, scaled by `layer`'s amax histories; the output
    has the autocast dtype inside autocast, else the input's dtype."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    record = layer.training and torch.is_grad_enabled()  # amax histories learn from training steps only
    with torch.autocast(device, enabled=False):  # the Function picks its own dtypes
        return _Fp8LinearFunction.apply(x, weight, bias, layer, out_dtype, record)


class Fp8Linear(Fp8Scales, nn.Linear):
    """nn.Linear whose matmuls run in fp8. Parameters (names, dtype, storage) are those of the
    layer it replaces, so checkpoints, weight tying and the optimizer see no difference."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scaling: str = "current",
                 history: int = HISTORY, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.init_scales(scaling, history)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: str = "current", history: int = HISTORY) -> "Fp8Linear":
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scaling=scaling,
                    history=history, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias  # the same Parameter objects
        layer.train(linear.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self)


def swap_linears(model: nn.Module, forms: dict, scaling: str) -> nn.Module:
    """Every linear of exactly a type in `forms` (its type -> its fp8 class, whose `from_linear`
    moves its parameters over) swapped for its fp8 form, in place, but the LM head (it stays in the
    autocast dtype: precision/policy.py says why). Exactly those types: a wrapper of a linear (an
    adapter) is looked into, not replaced."""
    head = getattr(model, "lm_head", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in forms and child is not head:
                setattr(parent, name, forms[type(child)].from_linear(child, scaling))
    return model
