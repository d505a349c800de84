"""Activation recomputation, applied to a built model from outside (the model file knows nothing
of it): trade FLOPs in backward for activation memory (Chen et al. 2016; Korthikanti et al. 2022).

  full       each block keeps only its input; backward reruns the block's forward first.
  selective  only the attention core (q, k, v -> softmax(QK^T)V) is rerun: it holds the
             s x s terms that dominate memory at long sequence length, for a small share of
             the FLOPs (Korthikanti et al. 2022, section 4.2).

Both wrap a module in `Recompute`, which runs it under torch.utils.checkpoint in its non-reentrant
form (works with keyword arguments and with inputs that do not require grad). accounting/memory.py
counts what each mode keeps and accounting/flops.py the FLOPs it adds (HFU).
"""

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lmforge.recompute_modes import get_recompute

# The wrapped module's attribute name: the one torch's own checkpoint wrapper uses, which
# torch.distributed.checkpoint and FSDP remove from parameter names. State dicts here drop it too,
# so a block's parameters have the same names with and without recomputation.
WRAPPED = "_checkpoint_wrapped_module"
# The same for torch.compile's wrapper (train/compile.py): every segment canonical_name drops.
WRAPPER_SEGMENTS = (WRAPPED, "_orig_mod")


class Recompute(nn.Module):
    """Runs the wrapped module without keeping its intermediate activations; backward reruns it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.add_module(WRAPPED, module)
        keep_canonical_names(self, WRAPPED)

    @property
    def wrapped(self) -> nn.Module:
        return getattr(self, WRAPPED)

    def __getattr__(self, name: str):
        """Attributes of the wrapped module read through the wrapper (`blocks["0"].attn`), as
        parameter names without the wrapper's segment require."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__(WRAPPED), name)

    def forward(self, *args, **kwargs):
        return checkpoint(self.wrapped, *args, use_reentrant=False, **kwargs)


def keep_canonical_names(wrapper: nn.Module, segment: str) -> None:
    """Make `wrapper`'s state dict leave out (and its loading put back) the `segment` under which
    it holds the wrapped module, so that names are those of the unwrapped model."""
    wrapper._register_state_dict_hook(functools.partial(_drop_wrapper_prefix, segment))
    wrapper._register_load_state_dict_pre_hook(functools.partial(_add_wrapper_prefix, segment))


def _drop_wrapper_prefix(segment, module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(f"{prefix}{segment}.")]:
        state_dict[prefix + key[len(f"{prefix}{segment}."):]] = state_dict.pop(key)
    return state_dict


def _add_wrapper_prefix(segment, state_dict, prefix, *args):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(f"{prefix}{segment}.")]:
        state_dict[f"{prefix}{segment}.{key[len(prefix):]}"] = state_dict.pop(key)


def canonical_name(name: str) -> str:
    """A parameter's name as in the unwrapped model (what checkpoints store)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(f"{segment}.", "")
    return name


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Wrap the blocks (full) or their attention cores (selective) of `model` in `Recompute`."""
    chosen = get_recompute(mode)
    if any(isinstance(m, Recompute) for m in model.modules()):
        raise ValueError("recomputation is already applied to this model")
    if chosen.blocks:
        for name, block in model.blocks.items():
            model.blocks[name] = Recompute(block)
    elif chosen.attention_cores:
        for block in model.blocks.values():
            block.attn.core = Recompute(block.attn.core)
    return model
