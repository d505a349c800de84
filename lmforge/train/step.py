"""One optimizer step of any engine (lmforge/parallel/): the step a training run repeats
(train/loop.py), and what the multi-process tests and bench/ run step by step.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by its share of the step's target tokens (over every micro-batch and
rank: grad_accum for text windows, where every position is a target), so that the summed gradient
is the gradient of the mean loss over all the step's targets. Then: clip the global gradient norm,
set the scheduled learning rate, AdamW step.
"""

import torch

from lmforge.modes import Policy
from lmforge.parallel.parallelize import Engine
from lmforge.precision.policy import LossScaler


def train_step(engine: Engine, next_batch, grad_accum: int, lr: float, grad_clip: float, scaler: LossScaler,
               policy: Policy, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step of any data-parallel engine (lmforge/parallel/): `grad_accum` micro-batches
    from `next_batch()`, communicating only in the last one's backward; then unscale (fp16) and clip
    the global gradient norm, and the AdamW step at `lr` unless the loss or the gradients are not
    finite. Returns (loss of the step averaged over ranks, gradient norm before clipping, skipped).

    The step's loss is the mean over all its target tokens (every micro-batch, every rank): the
    engine divides each micro-batch loss by its share of them (parallel/engine.py, loss_divisors;
    grad_accum where the micro-batches hold as many) and averages the gradients over the ranks."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = engine.forward_backward(next_batch, grad_accum, scaler, policy, device)
    engine.finish_gradients()
    # unscale before clipping, so that the clip threshold applies to the true gradient norm
    found_inf, grad_norm = engine.unscale_and_clip(scaler, grad_clip)
    loss_sum = engine.mean_across_ranks(loss_sum)
    skipped = found_inf or not bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
    if not skipped:
        engine.step()
    scaler.update(skipped)
    engine.zero_grad()
    return loss_sum, grad_norm, skipped
