"""LoRA: low-rank adapters on frozen linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models").

A wrapped linear computes

    y = W x + b + (alpha / r) * B A x          A: (r, in_features), B: (out_features, r)

with the base W, b frozen and only A and B trained. A starts Kaiming-uniform (as the paper's code,
`nn.init.kaiming_uniform_(a=sqrt(5))`, the default of nn.Linear) and B at zero, so at step 0 the
model's outputs are exactly the base model's (section 4.1). Dividing by r keeps the size of the
update about the same when r changes, so alpha need not be re-tuned with it.

Only A and B need gradients and AdamW moments: for a d x d projection that is 2 r d numbers
instead of d^2. The activations of the frozen layers are still kept wherever the gradient of an
earlier adapter has to flow back through them (accounting/plan/make.py counts this).

Names: `LoRALinear` holds the base layer as its child `base`, but its state dict drops that
segment (as wrap.py drops its wrapper's), so the wrapped weight keeps its canonical
name (`blocks.0.attn.q_proj.weight`) and the adapters are `blocks.0.attn.q_proj.lora_A` / `lora_B`.
A checkpoint of the base loads into the wrapped model and the merged model saves as a plain one.
"""

import fnmatch
import math

import torch
import torch.nn as nn

from lmforge.common.errors import LmforgeError
from lmforge.model.names import keep_canonical_names

# The attention projections: the paper's choice (section 7.1: W_q and W_v already do well; all four
# do better at the same parameter budget in its table 5).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_TARGETS = ",".join(ATTENTION_TARGETS)
BASE = "base"


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-r update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        for param in base.parameters():
            param.requires_grad_(False)
        device = base.weight.device
        # fp32 whatever the base's dtype: a frozen bf16 base with adapters trained in fp32
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        if device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self._merged: torch.Tensor | None = None  # the base weight before merge(), restored by unmerge()
        keep_canonical_names(self, BASE, own=("lora_A", "lora_B"))

    @property
    def merged(self) -> bool:
        return self._merged is not None

    # the wrapped weight and bias under the names the state dict gives them (`q_proj.weight`), so
    # that code walking parameter names as attribute paths (torch.distributed.checkpoint) finds them
    weight = property(lambda self: self.base.weight)
    bias = property(lambda self: self.base.bias)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A, the update to the base weight, in fp32."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        # under autocast these matmuls run in its dtype; without it (fp32, bf16-pure) in the adapters' fp32
        update = self.reduce_ax(self.dropout(x).to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
        return y + (update * self.scaling).to(y.dtype)

    def reduce_ax(self, ax: torch.Tensor) -> torch.Tensor:
        """A x as B reads it (a row-parallel layer's partial sums add up first: parallel/tp_lora.py)."""
        return ax

    @torch.no_grad()
    def merge(self) -> None:
        """Fold (alpha / r) B A into the base weight: one matmul per layer at inference."""
        if self.merged:
            raise ValueError("this LoRA layer is already merged")
        weight = self.base.weight
        self._merged = weight.detach().clone()
        weight.copy_((weight.float() + self.delta_weight()).to(weight.dtype))

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the saved base weight (exact: a copy, not a subtraction that would round)."""
        if not self.merged:
            raise ValueError("this LoRA layer is not merged")
        self.base.weight.copy_(self._merged)
        self._merged = None

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


# wrap.py's wrapper segment (torch's checkpoint wrapper's name), spelt out here so that
# the model package (and accounting/, which counts adapters) imports nothing of train/
RECOMPUTE_SEGMENT = "_checkpoint_wrapped_module."


def canonical(name: str) -> str:
    """A module or parameter name without wrapper segments (recomputation's, LoRA's `base`)."""
    return name.replace(RECOMPUTE_SEGMENT, "").replace(f".{BASE}.", ".")


def parse_targets(targets: str | list[str]) -> list[str]:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    names = [t for t in names if t]
    if not names:
        raise LmforgeError("no LoRA targets given: name linear layers, e.g. --lora-targets q_proj,v_proj")
    return names


def target_layers(model: nn.Module, targets: str | list[str], kinds: tuple = (nn.Linear,)) -> dict[str, nn.Module]:
    """The linear layers (modules of `kinds`) of the blocks that a pattern names, by canonical name.
    A pattern (fnmatch) matches a layer's own name (`q_proj`), its path in a block (`attn.*`,
    `mlp.up_proj`) or its full name (`blocks.0.attn.q_proj`). A pattern that matches nothing stops
    with the names it could."""
    linears = {canonical(name): module for name, module in model.named_modules()
               if isinstance(module, kinds) and canonical(name).startswith("blocks.")}
    chosen: dict[str, nn.Linear] = {}
    for pattern in parse_targets(targets):
        found = {name: layer for name, layer in linears.items()
                 if any(fnmatch.fnmatchcase(form, pattern)
                        for form in (name, name.split(".", 2)[2], name.rsplit(".", 1)[1]))}
        if not found:
            known = sorted({name.rsplit(".", 1)[1] for name in linears})
            raise LmforgeError(f"LoRA target {pattern!r} matches no linear layer of this model; "
                               f"its layers are {', '.join(known)}")
        chosen.update(found)
    return chosen


def apply_lora(model: nn.Module, targets: str | list[str] = DEFAULT_TARGETS, rank: int = 16,
               alpha: float | None = None, dropout: float = 0.0, kinds: tuple = (nn.Linear,),
               wrap=LoRALinear) -> nn.Module:
    """Freeze every parameter of `model` and wrap the targeted linear layers in `LoRALinear`
    (in place). alpha None: 2 * rank (the paper's code and PEFT examples often use alpha = 2r).
    `kinds` and `wrap`: the layers that count as linear and the LoRALinear (sub)class that wraps
    them (parallel/tp_lora.py passes the tensor-parallel ones)."""
    if rank < 1:
        raise LmforgeError(f"LoRA rank must be >= 1, got {rank} (leave the rank out for full fine-tuning)")
    if not 0.0 <= dropout < 1.0:
        raise LmforgeError(f"LoRA dropout must be in [0, 1), got {dropout}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("LoRA is already applied to this model")
    chosen = target_layers(model, targets, kinds)
    for param in model.parameters():
        param.requires_grad_(False)
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    for layer in chosen.values():
        parent, name = parents[id(layer)]
        setattr(parent, name, wrap(layer, rank, float(alpha if alpha is not None else 2 * rank), dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by canonical name."""
    return {canonical(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters: `<canonical layer name>.lora_A` and `.lora_B`."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[f"{name}.lora_A"] = layer.lora_A.detach()
        out[f"{name}.lora_B"] = layer.lora_B.detach()
    return out


def load_adapter_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor], origin: str = "the adapter") -> None:
    """Copy adapters saved by `adapter_state_dict` into `model`'s LoRA layers; names and shapes
    must match exactly (an adapter of another base, rank or targets stops with one line)."""
    expected = adapter_state_dict(model)
    if set(tensors) != set(expected):
        only_file = sorted(set(tensors) - set(expected))
        only_model = sorted(set(expected) - set(tensors))
        detail = (f"{only_file[0]} is not a LoRA layer of this model" if only_file
                  else f"it lacks {only_model[0]}")
        raise LmforgeError(f"{origin} does not fit this model ({detail}): it was made for other LoRA targets "
                           f"or another base")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise LmforgeError(f"{origin} does not fit this model: {name} is {tuple(value.shape)} there, "
                               f"{tuple(expected[name].shape)} here (another rank or another base)")
    layers = lora_layers(model)
    with torch.no_grad():
        for name, value in tensors.items():
            layer_name, which = name.rsplit(".", 1)
            getattr(layers[layer_name], which).copy_(value)


def merge_lora(model: nn.Module) -> None:
    for layer in lora_layers(model).values():
        layer.merge()

