"""What wraps a built model from outside (train/setup.py applies them in its documented order;
the model file knows nothing of them): activation recomputation, the chunked head + loss, and
torch.compile. Each refuses to run twice.

Recomputation (`train.recompute`) trades FLOPs in backward for activation memory (Chen et al.
2016; Korthikanti et al. 2022).

  full       each block keeps only its input; backward reruns the block's forward first.
  selective  only the attention core (q, k, v -> softmax(QK^T)V) is rerun: it holds the
             s x s terms that dominate memory at long sequence length, for a small share of
             the FLOPs (Korthikanti et al. 2022, section 4.2).

Both wrap a module in `Recompute`, which runs it under torch.utils.checkpoint in its non-reentrant
form (works with keyword arguments and with inputs that do not require grad). accounting/memory.py
counts what each mode keeps and accounting/shapes.py the FLOPs it adds (HFU).

The chunked loss computes the LM head and the cross-entropy in chunks of tokens, so that the
(tokens x vocab) logits and their gradient never exist whole (`train.loss_chunk_tokens`; 0 keeps
the plain loss).

For N tokens, hidden states h (N, d) after the final norm and the head's weight W (V, d):

    z = h W^T,   loss = (1/N) sum_i [logsumexp(z_i) - z_i[y_i]],
    dloss/dz_i = (softmax(z_i) - onehot(y_i)) / N,   dh_i = dz_i W,   dW = sum_i dz_i^T h_i,

the sums over the targets that are not IGNORE_INDEX (a fine-tuning example's prompt and padding)
and N their count, as in the plain loss; a left-out token's row of dz is zero. A soft-capped head
(model.logit_softcap, model/recipe.py) scores c * tanh(z / c) instead of z, whose derivative
1 - tanh^2 = 1 - (capped / c)^2 multiplies dz row by row: still one row at a time.

The gradient of a row of z needs only that row, so the forward takes the tokens C at a time:
logits of C tokens, their loss and their gradient dz, folded at once into dh and dW; then the
chunk's logits are freed. Backward only multiplies the saved dh and dW by the incoming gradient
(a loss scale, 1/grad_accum). Saved for backward: dh (N x d) and dW (V x d) instead of the fp32
log-probabilities (N x V) — for GPT-2's vocabulary and 8 x 1024 tokens, 25 MB + 154 MB instead
of 1.6 GB, and the peak holds one chunk's C x V logits instead of all of them. No FLOPs are added
(the gradient matmuls are the ones backward would do), unlike checkpointed chunks, which would
rerun the head matmul. The Liger-Kernel "fused linear cross-entropy" computes the same.

Numerics follow the plain path (model/transformer.py): the matmuls run in the autocast dtype
(or the weights' dtype), the logits are rounded to it and then widened to fp32 for the softmax,
dz is rounded back to it before its two matmuls; dW is summed over chunks in fp32.

Compile (`train.compile=true`) applies torch.compile as torchtitan does it: each block, and the
loss piece (final norm, LM head, cross-entropy: model.loss), is replaced by
`torch.compile(module)`, a wrapper module holding the original under `_orig_mod`.

- Names stay canonical: torch.distributed.checkpoint drops `_orig_mod` from the names it gives
  optimizer state, and the wrapper's state dict drops it too (as Recompute's,
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
from torch.utils.checkpoint import checkpoint

from lmforge.common.errors import LmforgeError
from lmforge.model.names import keep_canonical_names
from lmforge.model.recipe import SoftcapHead, softcap
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.modes import get_recompute

# The wrapped module's attribute name: the one torch's own checkpoint wrapper uses, which
# torch.distributed.checkpoint and FSDP remove from parameter names. State dicts here drop it too,
# so a block's parameters have the same names with and without recomputation.
WRAPPED = "_checkpoint_wrapped_module"
COMPILED = "_orig_mod"  # where torch.compile's wrapper holds the module


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


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain LM head's matmul would run in: autocast's, else the operands'."""
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return torch.promote_types(h.dtype, weight.dtype)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          with_grads: bool, cap: float | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Mean cross-entropy of the logits h @ weight^T (never all formed; soft-capped at `cap` if
    given), and, `with_grads`, its gradients with respect to h (in h's dtype) and weight (in fp32)."""
    kept = targets != IGNORE_INDEX
    n = kept.sum()  # a tensor: no host sync; 0 gives NaN, as the plain loss does
    dtype = _compute_dtype(h, weight)
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if with_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if with_grads else None
        for start in range(0, h.shape[0], chunk):
            h_c, kept_c = h[start:start + chunk].to(dtype), kept[start:start + chunk]
            y_c = targets[start:start + chunk].where(kept_c, 0)  # a left-out target reads row 0, then is masked
            # rounded to the compute dtype by the matmul, as plain; capped as SoftcapHead caps, in that dtype
            logits = softcap(h_c @ w.t(), cap).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, y_c[:, None]).squeeze(1)) * kept_c).sum()
            if with_grads:  # in place: one chunk of fp32 logits (and its cast) at a time, no more
                squash = 1.0 - (logits / cap).square() if cap is not None else None  # d capped / d z
                grad_z = logits.sub_(lse[:, None]).exp_()  # softmax
                grad_z[torch.arange(len(y_c), device=h.device), y_c] -= 1.0
                grad_z = grad_z.mul_(kept_c[:, None]).div_(n)
                grad_z = (grad_z.mul_(squash) if cap is not None else grad_z).to(dtype)
                grad_h[start:start + chunk] = grad_z @ w
                grad_w += (grad_z.t() @ h_c).float()
    return loss / n, grad_h, grad_w


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, cap=None):
        loss, grad_h, grad_w = chunked_cross_entropy(h, weight, targets, chunk, with_grads=True, cap=cap)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None)


class ChunkedHeadLoss(nn.Module):
    """Drop-in for model/transformer.py's HeadLoss: norm, head and loss, `chunk_tokens` at a time."""

    def __init__(self, chunk_tokens: int):
        super().__init__()
        self.chunk_tokens = chunk_tokens

    def forward(self, x, norm, lm_head, targets):
        _check_head(lm_head)
        h = norm(x).flatten(0, 1)
        targets, cap = targets.flatten(), getattr(lm_head, "cap", None)  # a SoftcapHead's cap, else None
        if torch.is_grad_enabled() and (h.requires_grad or lm_head.weight.requires_grad):
            return _ChunkedCrossEntropy.apply(h, lm_head.weight, targets, self.chunk_tokens, cap)
        return chunked_cross_entropy(h, lm_head.weight, targets, self.chunk_tokens, with_grads=False, cap=cap)[0]

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}"


def _check_head(lm_head: nn.Module) -> None:
    if type(lm_head) not in (nn.Linear, SoftcapHead) or lm_head.bias is not None:
        raise LmforgeError(f"train.loss_chunk_tokens needs the LM head to be a plain (or soft-capped) bias-free "
                           f"linear layer, "
                           f"not {type(lm_head).__name__}: set train.loss_chunk_tokens=0")


def apply_chunked_loss(model: nn.Module, chunk_tokens: int) -> nn.Module:
    """Replace `model.loss` by the chunked version (chunk_tokens > 0); 0 leaves the plain loss."""
    if chunk_tokens and getattr(model, "lm_head", None) is not None:
        _check_head(model.lm_head)
        if isinstance(model.loss, ChunkedHeadLoss):
            raise ValueError("the chunked loss is already applied to this model")
        model.loss = ChunkedHeadLoss(chunk_tokens)
    return model


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
