"""Learning rate: linear warmup, then cosine decay to a floor (Loshchilov & Hutter 2017, SGDR
eq. 5 without restarts; the schedule of GPT-3, Brown et al. 2020, appendix B)."""

import math


def learning_rate(step: int, *, peak: float, floor: float, warmup_steps: int, total_steps: int) -> float:
    """The rate for optimizer step `step` (0-based) of `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
