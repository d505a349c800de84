"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2).

fp16 has 5 exponent bits: gradients below 2**-24 (about 6e-8) flush to zero, and in their
figure 3 a large share of activation gradients of a real network lies there. Multiplying the
loss by S before backward shifts every gradient up by S (the chain rule is linear), into fp16's
range; the gradients are divided by S again, in fp32, before anything uses them (clipping, the
optimizer). S is chosen dynamically:
    - an inf/NaN anywhere in the gradients means S was too large: skip this optimizer step and
      multiply S by `backoff_factor`;
    - after `growth_interval` steps in a row without one, multiply S by `growth_factor`, to use as
      much of the range as the gradients allow.
The defaults, and the exact order of these rules, are those of `torch.amp.GradScaler`; the tests
run both on the same gradient sequences.
"""

import torch


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and init_scale > 0):
            raise ValueError(f"invalid loss scaler settings: growth_factor={growth_factor} (> 1), "
                             f"backoff_factor={backoff_factor} (in (0, 1)), growth_interval={growth_interval} "
                             f"(> 0), init_scale={init_scale} (> 0)")
        self.enabled = enabled
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # steps in a row without inf/NaN since the scale last changed
        self.skipped_steps = 0  # total steps skipped for inf/NaN gradients

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale, in place; True if any is inf or NaN.

        The gradients here are those of fp32 master weights, so the division happens in fp32
        (section 3.1 of the paper: fp32 master copy), and clipping afterwards sees true norms."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.enabled or not grads:
            return not all(torch.isfinite(g).all() for g in grads)
        inv_scale = torch.tensor(1.0 / self.scale_value, dtype=torch.float32)
        found_inf = torch.zeros((), dtype=torch.bool, device=grads[0].device)
        for g in grads:
            found_inf |= ~torch.isfinite(g).all()
            g.mul_(inv_scale.to(g.device, g.dtype))
        return bool(found_inf)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (taken, or skipped when found_inf)."""
        if not self.enabled:
            return
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale_value * self.growth_factor
            if grown != float("inf"):  # as GradScaler: never grow to an infinite scale
                self.scale_value = grown
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval, self.enabled = int(state["growth_interval"]), bool(state["enabled"])
