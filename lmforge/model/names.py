"""Canonical parameter names: those of the unwrapped model, which checkpoints store.

The wrappers applied from outside (lmforge/wrap.py: recomputation, torch.compile) hold the wrapped
module under a segment of their own; torch.distributed.checkpoint and FSDP drop those segments
from the names they see, and so do the state dicts here, so a parameter has one name whether or
not its block is wrapped.
"""

import functools

import torch.nn as nn

# torch's checkpoint wrapper's attribute (wrap.py uses the same) and torch.compile's
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def keep_canonical_names(wrapper: nn.Module, segment: str, own: tuple[str, ...] = ()) -> None:
    """Make `wrapper`'s state dict leave out (and its loading put back) the `segment` under which
    it holds the wrapped module, so that names are those of the unwrapped model; `own`: the
    wrapper's own entries (a LoRA layer's adapters: model/lora.py), left as they are."""
    wrapper._register_state_dict_hook(functools.partial(_drop_wrapper_prefix, segment))
    wrapper._register_load_state_dict_pre_hook(functools.partial(_add_wrapper_prefix, segment, own))


def _drop_wrapper_prefix(segment, module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(f"{prefix}{segment}.")]:
        state_dict[prefix + key[len(f"{prefix}{segment}."):]] = state_dict.pop(key)
    return state_dict


def _add_wrapper_prefix(segment, own, state_dict, prefix, *args):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(f"{prefix}{segment}.")
                and k[len(prefix):] not in own]:
        state_dict[f"{prefix}{segment}.{key[len(prefix):]}"] = state_dict.pop(key)


def canonical_name(name: str) -> str:
    """A parameter's name as in the unwrapped model (what checkpoints store)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(f"{segment}.", "")
    return name
