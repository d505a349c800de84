"""Precision policies applied to a model: the torch side of the policies named in policies.py
(which holds the table of what each stores and computes in, and its bytes).

The mixed policies follow Micikevicius et al. 2018 ("Mixed Precision Training"): an fp32 master
copy of the weights takes the updates, because an update smaller than half a unit in the last
place of a 16-bit weight is rounded away (their section 3.1); bf16 has fp32's exponent range, so
it needs no loss scaling, fp16 does (section 3.2). bf16-pure drops the master copy to halve
parameter and optimizer memory and pays exactly that rounding: the optimizer counts the updates
lost to it (optim/adamw.py, `count_lost_updates`).

Under every policy, normalisation, softmax and the cross-entropy run in at least fp32 (the model
already promotes them); `fp32_attention` also moves the attention core (Q K^T, softmax, P V) to
fp32 while the projections stay in low precision.

fp8 (Micikevicius et al. 2022, fp8.py) replaces the linear layers of the blocks; the LM head stays
in bf16 under autocast: it is tied to the embedding table, its output is the logits that the
softmax over the whole vocabulary exponentiates (where a 3-bit mantissa costs most), and it is one
matmul of 7 * n_layers + 1, so keeping it wider costs little. Common fp8 recipes do the same.

Policies wrap the model from outside (`prepare_model`, `autocast`); the model code knows nothing
of them; fp32 attention wraps each attention core in an `Fp32Attention` module.
"""

import contextlib

import torch
import torch.nn as nn

from lmforge.common.errors import LmforgeError, lookup
from lmforge.model.transformer import Attention
from lmforge.precision.fp8 import Fp8Linear, Fp8Scales, hardware_fp8, swap_linears
from lmforge.modes import FP8_SCALINGS, Policy


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a name in policies.py ("bfloat16" -> torch.bfloat16); None stays None."""
    return getattr(torch, name) if name is not None else None


def device_notes(policy: Policy, device: torch.device) -> list[str]:
    """Stop if the device cannot run the policy at all; otherwise notes on what it will cost."""
    notes = []
    if device.type == "cuda":
        uses_bf16 = "bfloat16" in (policy.param_dtype, policy.compute_dtype)
        if uses_bf16 and not torch.cuda.is_bf16_supported():
            raise LmforgeError(f"train.precision={policy.name} needs bfloat16, which {device} does not "
                               f"support (compute capability below 8.0): use fp16-mixed or fp32")
        if policy.fp8 and not hardware_fp8(device):
            notes.append(f"{device} has no fp8 matmul (needs compute capability 8.9+): fp8 is simulated "
                         f"(same numbers, no speed-up)")
    elif device.type == "cpu":
        if policy.compute_dtype == "float16":
            notes.append("fp16 on CPU: no hardware fp16 matmul, each one is emulated and runs tens of "
                         "times slower than fp32 (bench/RESULTS.md); use it here only to study its numerics")
        if policy.fp8:
            notes.append("fp8 on CPU: the fp8 matmuls are simulated (same numbers, no speed-up)")
    return notes


def prepare_model(model: nn.Module, policy: Policy, fp32_attention: bool = False,
                  fp8_scaling: str = "current") -> nn.Module:
    """Apply `policy` to a freshly built model, in place, before the optimizer is created:
    parameter dtype, then fp8 linears (a module swap), then fp32 attention (a wrapper module)."""
    lookup(FP8_SCALINGS, fp8_scaling, "fp8 scaling")
    if any(isinstance(m, (Fp8Scales, Fp32Attention)) for m in model.modules()) or any(
            p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("a precision policy is already applied to this model")
    if policy.param_dtype != "float32":
        # parameters only: buffers (the rotary tables) stay fp32, or positions lose precision
        for param in dict.fromkeys(model.parameters()):  # tied parameters once
            param.data = param.data.to(torch_dtype(policy.param_dtype))
    if policy.fp8:
        swap_linears(model, {nn.Linear: Fp8Linear}, fp8_scaling)
    if fp32_attention:
        for attention in [m for m in model.modules() if isinstance(m, Attention)]:
            attention.core = Fp32Attention(attention.core)
    return model


class Fp32Attention(nn.Module):
    """Runs the wrapped attention core on fp32 copies of q, k, v, outside autocast (which would
    cast them back down), and returns its output in q's dtype."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core

    def forward(self, q, k, v):
        with torch.autocast(q.device.type, enabled=False):
            return self.core(q.float(), k.float(), v.float()).to(q.dtype)


def autocast(policy: Policy, device: torch.device):
    """The context for forward passes under `policy` (backward runs outside it, as autocast wants)."""
    if not policy.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch_dtype(policy.compute_dtype))


def fp8_scale_state(model: nn.Module) -> dict:
    """The amax histories of every fp8 layer (delayed scaling), by module name, for checkpoints."""
    return {name: m.scale_state() for name, m in model.named_modules() if isinstance(m, Fp8Scales)}


def load_fp8_scale_state(model: nn.Module, state: dict) -> None:
    for name, module in model.named_modules():
        if isinstance(module, Fp8Scales) and name in state:
            module.load_scale_state(state[name])


# Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2).
#
# fp16 has 5 exponent bits: gradients below 2**-24 (about 6e-8) flush to zero, and in their
# figure 3 a large share of activation gradients of a real network lies there. Multiplying the
# loss by S before backward shifts every gradient up by S (the chain rule is linear), into fp16's
# range; the gradients are divided by S again, in fp32, before anything uses them (clipping, the
# optimizer). S is chosen dynamically:
#     - an inf/NaN anywhere in the gradients means S was too large: skip this optimizer step and
#       multiply S by `backoff_factor`;
#     - after `growth_interval` steps in a row without one, multiply S by `growth_factor`, to use as
#       much of the range as the gradients allow.
# The defaults, and the exact order of these rules, are those of `torch.amp.GradScaler`; the tests
# run both on the same gradient sequences.
class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and init_scale > 0):
            raise ValueError(f"invalid loss scaler settings: growth_factor={growth_factor} (> 1), "
                             f"backoff_factor={backoff_factor} (in (0, 1)), growth_interval={growth_interval} "
                             f"(> 0), init_scale={init_scale} (> 0)")
        self.enabled = enabled
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # steps in a row without inf/NaN since the scale last changed
        self.skipped_steps = 0  # total steps skipped for inf/NaN gradients

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale, in place; True if any is inf or NaN.

        The gradients here are those of fp32 master weights, so the division happens in fp32
        (section 3.1 of the paper: fp32 master copy), and clipping afterwards sees true norms."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.enabled or not grads:
            return not all(torch.isfinite(g).all() for g in grads)
        inv_scale = torch.tensor(1.0 / self.scale_value, dtype=torch.float32)
        found_inf = torch.zeros((), dtype=torch.bool, device=grads[0].device)
        for g in grads:
            found_inf |= ~torch.isfinite(g).all()
            g.mul_(inv_scale.to(g.device, g.dtype))
        return bool(found_inf)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (taken, or skipped when found_inf)."""
        if not self.enabled:
            return
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale_value * self.growth_factor
            if grown != float("inf"):  # as GradScaler: never grow to an infinite scale
                self.scale_value = grown
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval, self.enabled = int(state["growth_interval"]), bool(state["enabled"])
