"""Precision policies: what parameters, optimizer states and matmuls are stored and computed in.

    policy       parameters  grads  AdamW m, v  forward matmuls        loss scaling
    fp32         fp32        fp32   fp32        fp32                   no
    bf16-mixed   fp32        fp32   fp32        bf16 (autocast)        no
    fp16-mixed   fp32        fp32   fp32        fp16 (autocast)        dynamic (loss_scaler.py)
    bf16-pure    bf16        bf16   bf16        bf16                   no
    fp8          fp32        fp32   fp32        fp8 linears, rest bf16 no (per-tensor fp8 scales)

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
from dataclasses import dataclass

import torch
import torch.nn as nn

from lmforge.errors import LmforgeError
from lmforge.model.transformer import Attention
from lmforge.precision.fp8 import SCALINGS, Fp8Linear, hardware_fp8


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: torch.dtype  # parameters, their gradients and the AdamW moments
    compute_dtype: torch.dtype | None  # autocast dtype of the forward pass; None: no autocast
    loss_scaling: bool  # dynamic loss scaling (fp16)
    fp8: bool  # the blocks' linear layers compute in fp8

    @property
    def lossy_updates(self) -> bool:
        """Parameters in 16 bits: small updates can round to nothing (worth counting)."""
        return self.param_dtype != torch.float32


POLICIES = {
    "fp32": Policy("fp32", torch.float32, None, loss_scaling=False, fp8=False),
    "bf16-mixed": Policy("bf16-mixed", torch.float32, torch.bfloat16, loss_scaling=False, fp8=False),
    "fp16-mixed": Policy("fp16-mixed", torch.float32, torch.float16, loss_scaling=True, fp8=False),
    "bf16-pure": Policy("bf16-pure", torch.bfloat16, None, loss_scaling=False, fp8=False),
    "fp8": Policy("fp8", torch.float32, torch.bfloat16, loss_scaling=False, fp8=True),
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise LmforgeError(f"unknown precision {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def device_notes(policy: Policy, device: torch.device) -> list[str]:
    """Stop if the device cannot run the policy at all; otherwise notes on what it will cost."""
    notes = []
    if device.type == "cuda":
        uses_bf16 = torch.bfloat16 in (policy.param_dtype, policy.compute_dtype)
        if uses_bf16 and not torch.cuda.is_bf16_supported():
            raise LmforgeError(f"train.precision={policy.name} needs bfloat16, which {device} does not "
                               f"support (compute capability below 8.0): use fp16-mixed or fp32")
        if policy.fp8 and not hardware_fp8(device):
            notes.append(f"{device} has no fp8 matmul (needs compute capability 8.9+): fp8 is simulated "
                         f"(same numbers, no speed-up)")
    elif device.type == "cpu":
        if policy.compute_dtype == torch.float16:
            notes.append("fp16 on CPU: no hardware fp16 matmul, each one is emulated and runs tens of "
                         "times slower than fp32 (bench/RESULTS.md); use it here only to study its numerics")
        if policy.fp8:
            notes.append("fp8 on CPU: the fp8 matmuls are simulated (same numbers, no speed-up)")
    return notes


def prepare_model(model: nn.Module, policy: Policy, fp32_attention: bool = False,
                  fp8_scaling: str = "current") -> nn.Module:
    """Apply `policy` to a freshly built model, in place, before the optimizer is created:
    parameter dtype, then fp8 linears (a module swap), then fp32 attention (a wrapper module)."""
    if fp8_scaling not in SCALINGS:
        raise LmforgeError(f"fp8 scaling must be one of {', '.join(SCALINGS)}, got {fp8_scaling!r}")
    if any(isinstance(m, (Fp8Linear, Fp32Attention)) for m in model.modules()) or any(
            p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("a precision policy is already applied to this model")
    if policy.param_dtype != torch.float32:
        # parameters only: buffers (the rotary tables) stay fp32, or positions lose precision
        for param in dict.fromkeys(model.parameters()):  # tied parameters once
            param.data = param.data.to(policy.param_dtype)
    if policy.fp8:
        head = getattr(model, "lm_head", None)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                # exactly nn.Linear: a wrapper of a linear (an adapter) is looked into, not replaced
                if type(child) is nn.Linear and child is not head:
                    setattr(parent, name, Fp8Linear.from_linear(child, scaling=fp8_scaling))
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
    if policy.compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=policy.compute_dtype)


def fp8_scale_state(model: nn.Module) -> dict:
    """The amax histories of every fp8 layer (delayed scaling), by module name, for checkpoints."""
    return {name: m.scale_state() for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def load_fp8_scale_state(model: nn.Module, state: dict) -> None:
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) and name in state:
            module.load_scale_state(state[name])
