"""Learning rate: linear warmup, then cosine decay to a floor (Loshchilov & Hutter 2017, SGDR
eq. 5 without restarts; the schedule of GPT-3, Brown et al. 2020, appendix B), or with
optim.schedule=wsd warmup-stable-decay (MiniCPM, Hu et al. 2024; Hägele et al. 2024).

Steps are 0-based: step s sets the rate of the (s+1)-th optimizer update. With W = warmup_steps
and D = decay_steps, warmup and decay meet at one step, W - 1, the only one at the peak:

    s <  W - 1          peak * (s + 1) / W                 rising: peak/W, 2 peak/W, ...
    s == W - 1          peak                               the last warmup step is the first of the cosine
    W - 1 < s < D - 1   floor + (peak - floor) * (1 + cos(pi * (s - W + 1) / (D - W))) / 2
    s >= D - 1          floor                              the schedule's last step, and any after it

W = 0 and W = 1 both start at the peak. D is fixed when a run starts (optim.decay_steps, by
default train.max_steps then), so extending a finished run with a larger train.max_steps trains
on at the floor instead of re-stretching the cosine under the steps already taken. A schedule
with no room to decay (D <= W) stays at the peak after its warmup.

Warmup-stable-decay (kind "wsd") holds the peak and decays only over the last K = round(f * D) steps
(f = optim.decay_fraction), linearly (Hägele et al. 2024, section 3: linear to the floor matches a
cosine's loss; their 1 - sqrt is a little better, linear is the plain one). With S = D - 1 - K, the
last step at the peak (never before W - 1: a decay longer than the room after warmup starts there):

    s <  W - 1          peak * (s + 1) / W                 the same warmup
    W - 1 <= s <= S     peak                               stable
    S < s < D - 1       floor + (peak - floor) * (D - 1 - s) / (D - 1 - S)
    s >= D - 1          floor

so a run stopped anywhere in the stable phase can be cooled down later by setting D there.
f = 0 never decays; f = 1 decays from the peak step on, linearly.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    peak: float
    floor: float
    warmup_steps: int
    decay_steps: int
    kind: str = "cosine"  # cosine | wsd (optim.schedule)
    decay_fraction: float = 0.2  # wsd: the share of decay_steps spent decaying

    @classmethod
    def of(cls, cfg) -> "Schedule":
        """The schedule of a Config; optim.decay_steps=None (not fixed yet) stands for train.max_steps."""
        o = cfg.optim
        return cls(peak=o.lr, floor=o.lr * o.min_lr_ratio, warmup_steps=o.warmup_steps,
                   decay_steps=o.decay_steps or cfg.train.max_steps, kind=o.schedule, decay_fraction=o.decay_fraction)

    @property
    def peak_step(self) -> int:
        return max(self.warmup_steps, 1) - 1

    def __call__(self, step: int) -> float:
        """The rate of optimizer step `step` (0-based)."""
        if step < self.peak_step:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "wsd":
            last_peak = max(self.decay_steps - 1 - round(self.decay_fraction * self.decay_steps), self.peak_step)
        else:
            last_peak = self.peak_step
        decay = self.decay_steps - 1 - last_peak  # steps from the last peak step down to the floor
        if decay <= 0 or step < last_peak:
            return self.peak
        progress = min(1.0, (step - last_peak) / decay)
        if self.kind == "wsd":
            return self.floor + (self.peak - self.floor) * (1.0 - progress)
        return self.floor + 0.5 * (self.peak - self.floor) * (1.0 + math.cos(math.pi * progress))


# The settings behind each field, to name what changed at a resume.
SETTINGS = {"peak": "optim.lr", "floor": "floor (optim.lr * optim.min_lr_ratio)",
            "warmup_steps": "optim.warmup_steps", "decay_steps": "optim.decay_steps",
            "kind": "optim.schedule", "decay_fraction": "optim.decay_fraction"}


def resume_note(step: int, before: Schedule, after: Schedule, max_steps: int) -> str:
    """What the learning rate does when a run that has taken `step` steps under `before` goes on
    under `after` (the resumed settings) to `max_steps`: one line for the user."""
    last, nxt = before(step - 1), after(step)
    if not math.isclose(nxt, before(step), rel_tol=1e-12):
        changed = ", ".join(f"{key} {_shown(getattr(before, field))} -> {_shown(getattr(after, field))}"
                            for field, key in SETTINGS.items() if getattr(before, field) != getattr(after, field))
        then = _remaining(step, after, max_steps)
        return f"the learning rate jumps from {last:.3g} to {nxt:.3g} ({changed}), then {then}"
    if step >= after.decay_steps and after.decay_steps > after.peak_step + 1:
        return (f"the schedule ended at step {after.decay_steps}: the learning rate stays at its floor "
                f"{after.floor:.3g} to step {max_steps} (set optim.decay_steps to stretch it)")
    return f"the learning rate continues its schedule from {nxt:.3g}: {_remaining(step, after, max_steps)}"


def _shown(value) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def _remaining(step: int, schedule: Schedule, max_steps: int) -> str:
    if max_steps <= schedule.peak_step:  # the run ends inside the warmup
        return (f"rises to {schedule(max_steps - 1):.3g} at step {max_steps}, still warming up "
                f"(optim.warmup_steps={schedule.warmup_steps})")
    start = f"rises to {schedule.peak:.3g} at step {schedule.peak_step + 1}, " if step < schedule.peak_step else ""
    if schedule.decay_steps <= schedule.peak_step + 1:
        return f"{start}{'then ' * bool(start)}stays at {schedule.peak:.3g} to step {max_steps} (no room to decay)"
    if step >= schedule.decay_steps:
        return f"stays at its floor {schedule.floor:.3g} to step {max_steps}"
    if schedule.decay_steps >= max_steps:
        return f"{start}decays to {schedule(max_steps - 1):.3g} at step {max_steps}"
    return (f"{start}decays to its floor {schedule.floor:.3g} at step {schedule.decay_steps} and stays there "
            f"to step {max_steps}")
