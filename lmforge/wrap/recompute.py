"""Activation recomputation, applied to a built model from outside (the model file knows nothing
of it): trade FLOPs in backward for activation memory (Chen et al. 2016; Korthikanti et al. 2022).

  full       each block keeps only its input; backward reruns the block's forward first.
  selective  only the attention core (q, k, v -> softmax(QK^T)V) is rerun: it holds the
             s x s terms that dominate memory at long sequence length, for a small share of
             the FLOPs (Korthikanti et al. 2022, section 4.2).

Both wrap a module in `Recompute`, which runs it under torch.utils.checkpoint in its non-reentrant
form (works with keyword arguments and with inputs that do not require grad). accounting/memory.py
counts what each mode keeps and accounting/shapes.py the FLOPs it adds (HFU).
"""

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lmforge.model.names import keep_canonical_names
from lmforge.modes.recompute import get_recompute

# The wrapped module's attribute name: the one torch's own checkpoint wrapper uses, which
# torch.distributed.checkpoint and FSDP remove from parameter names. State dicts here drop it too,
# so a block's parameters have the same names with and without recomputation.
WRAPPED = "_checkpoint_wrapped_module"


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
