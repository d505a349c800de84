"""Activation recomputation, applied to a built model from outside (the model file knows nothing
of it): trade FLOPs in backward for activation memory (Chen et al. 2016; Korthikanti et al. 2022).

  full       each block keeps only its input; backward reruns the block's forward first.
  selective  only the attention core (q, k, v -> softmax(QK^T)V) is rerun: it holds the
             s x s terms that dominate memory at long sequence length, for a small share of
             the FLOPs (Korthikanti et al. 2022, section 4.2).

Both use torch.utils.checkpoint in its non-reentrant form, which works with keyword arguments
and with inputs that do not require grad. accounting/memory.py counts what each mode keeps and
accounting/flops.py the FLOPs it adds (HFU).
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from lmforge.config import RECOMPUTE


def apply_recompute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Make `model` recompute activations in backward according to `mode`; returns the model."""
    if mode not in RECOMPUTE:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(RECOMPUTE)}")
    if mode == "none":
        return model
    for block in model.blocks:
        if mode == "full":
            # An instance attribute shadows the class's forward; nn.Module.__call__ runs it.
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        else:
            block.attn.attention_core = functools.partial(checkpoint, block.attn.attention_core,
                                                          use_reentrant=False)
    return model
