"""Stopping a run whose steps keep going bad.

A step whose loss or gradients are not finite is skipped (train/loop.py's train_step); one now
and then is normal, under fp16-mixed even expected (the loss scaler lowers its scale). Too many in
a row stop the run, before the step is checkpointed, so that the last checkpoint on disk is a
good one.
"""

import math
from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.precision.policy import LossScaler
from lmforge.runs.checkpoint.find import kept_checkpoint
from lmforge.runs.state import RunState

# Under fp16-mixed a step with inf/NaN gradients is skipped and the loss scale halved: normal at
# the start of a run and now and then later. This many skips in a row (the scale fell 2**64-fold)
# mean no scale helps: the forward pass itself overflows fp16.
FP16_MAX_SKIPS_IN_A_ROW = 64


def check_bad_steps(state: RunState, scaler: LossScaler, max_bad_steps: int, run_dir: Path, loss: float,
                    grad_norm: float) -> None:
    """After a bad (skipped) step of `loss` and `grad_norm`: count it, and stop the run when they
    keep coming (train.max_bad_steps in a row; under fp16-mixed, FP16_MAX_SKIPS_IN_A_ROW)."""
    state.bad_in_a_row += 1
    if scaler.enabled:
        if state.bad_in_a_row >= FP16_MAX_SKIPS_IN_A_ROW:
            raise LmforgeError(f"{state.bad_in_a_row} steps in a row had inf/NaN gradients up to step "
                               f"{state.step} (loss scale now {scaler.scale_value:g}): fp16 overflows in "
                               f"the forward pass; " + kept_checkpoint(run_dir, "use bf16-mixed or lower optim.lr"))
    elif state.bad_in_a_row >= max_bad_steps:
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
        raise LmforgeError(f"{what} at step {state.step}; " + kept_checkpoint(
            run_dir, f"lower optim.lr or raise optim.warmup_steps (train.max_bad_steps="
                     f"{max_bad_steps} bad steps in a row allowed)"))
