"""torch.compile applied from outside (`train.compile=true`), as torchtitan does it: each block,
and the loss piece (final norm, LM head, cross-entropy: model.loss), is replaced by
`torch.compile(module)`, a wrapper module holding the original under `_orig_mod`.

- Names stay canonical: torch.distributed.checkpoint drops `_orig_mod` from the names it gives
  optimizer state, and the wrapper's state dict drops it too (wrap/recompute.py
  keep_canonical_names), so a checkpoint of a compiled run has the names of an uncompiled one.
- One compile for all blocks: they run the same code and torch.compile passes parameters as graph
  inputs, so the graph of block 0 serves every layer (and one more for the loss piece).
- Training forwards only: a forward of the model with gradients off (evaluation, and generation,
  whose KV-cache shapes change every token and would recompile again and again) runs the same
  modules eagerly, by torch.compiler.set_stance("force_eager") from hooks on the model.
- Inductor's kernels compute the same functions in another order of operations (fused,
  vectorised), so a compiled run is not bit-identical to an eager one; tests/test_compile.py
  checks it to a tolerance, and that a compiled run resumes bit for bit.

Combinations: every precision policy, recomputation mode and attention backend compiles
(recomputation's torch.utils.checkpoint is traced as one region) except flash_triton, whose
kernels torch.compile would have to trace on a GPU, untried (config/validate.py refuses it with one line).
"""

import torch
import torch.nn as nn

from lmforge.model.names import keep_canonical_names

COMPILED = "_orig_mod"  # where torch.compile's wrapper holds the module


def _compiled(module: nn.Module, backend: str) -> nn.Module:
    wrapper = torch.compile(module, backend=backend)
    keep_canonical_names(wrapper, COMPILED)
    return wrapper


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Replace each block of `model` and its loss piece by a compiled wrapper, in place. `backend`
    is torch.compile's ("eager" traces without generating code: the GPU check's CPU dry run)."""
    if any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules()):
        raise ValueError("torch.compile is already applied to this model")
    for name, block in model.blocks.items():
        model.blocks[name] = _compiled(block, backend)
    if getattr(model, "lm_head", None) is not None:
        model.loss = _compiled(model.loss, backend)
    model.register_forward_pre_hook(_eager_without_grad)
    model.register_forward_hook(_end_eager, always_call=True)
    return model


_stances: list = []  # the eager stances entered by _eager_without_grad, innermost last


def _eager_without_grad(module, args):
    stance = torch.compiler.set_stance("force_eager") if not torch.is_grad_enabled() else None
    if stance is not None:
        stance.__enter__()
    _stances.append(stance)


def _end_eager(module, args, output):
    stance = _stances.pop() if _stances else None
    if stance is not None:
        stance.__exit__(None, None, None)
