"""The learning-rate schedule (lmforge/optim/schedule.py) and what extending a run does to it."""

import json
import math
import subprocess
import sys

import pytest

from lmforge.optim.schedule import Schedule, resume_note
from tests.conftest import tiny_overrides


def test_warmup_and_decay_meet_at_one_peak_step():
    """The convention of the module docstring, value by value: W = 4 rising steps ending at the
    peak, which is also the first step of the cosine; the floor at step D - 1 and after."""
    lr = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=10)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * k / 6)) for k in range(7)]  # steps 3..9: D - W = 6 intervals
    assert [lr(s) for s in range(3, 10)] == pytest.approx(cosine, rel=1e-12)
    assert lr(4) < 1.0  # the peak is held for one step only
    assert lr(8) > lr(9) == pytest.approx(0.1, rel=1e-12) == lr(10) == lr(1000)
    values = [lr(s) for s in range(12)]
    assert values.index(max(values)) == 3 and values.count(1.0) == 1


def test_no_warmup_starts_at_the_peak_and_a_schedule_too_short_to_decay_holds_it():
    for warmup in (0, 1):
        lr = Schedule(peak=2.0, floor=0.2, warmup_steps=warmup, decay_steps=5)
        assert [lr(s) for s in range(6)] == pytest.approx([2.0, 0.2 + 0.9 * (1 + math.sqrt(0.5)), 1.1,
                                                          0.2 + 0.9 * (1 - math.sqrt(0.5)), 0.2, 0.2], rel=1e-12)
    lr = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=3)
    assert [lr(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_resume_notes_say_what_the_rate_will_do():
    before = Schedule(peak=1e-3, floor=1e-4, warmup_steps=2, decay_steps=6)
    assert resume_note(6, before, before, 10) == ("the schedule ended at step 6: the learning rate stays at its "
                                                  "floor 0.0001 to step 10 (set optim.decay_steps to stretch it)")
    assert resume_note(3, before, before, 10) == ("the learning rate continues its schedule from 0.00055: decays "
                                                  "to its floor 0.0001 at step 6 and stays there to step 10")
    stretched = Schedule(peak=1e-3, floor=1e-4, warmup_steps=2, decay_steps=12)
    assert resume_note(6, before, stretched, 12) == (
        f"the learning rate jumps from 0.0001 to {stretched(6):.3g} (optim.decay_steps 6 -> 12), then decays "
        f"to 0.0001 at step 12")
    lower = Schedule(peak=5e-4, floor=5e-5, warmup_steps=2, decay_steps=6)
    assert resume_note(8, before, lower, 10) == ("the learning rate jumps from 0.0001 to 5e-05 (optim.lr 0.001 -> "
                                                 "0.0005, floor (optim.lr * optim.min_lr_ratio) 0.0001 -> 5e-05), "
                                                 "then stays at its floor 5e-05 to step 10")
    # a warmup longer than the run: the rate rises to the run's end, it never holds the peak
    long_warmup = Schedule(peak=3e-3, floor=3e-4, warmup_steps=50, decay_steps=8)
    assert resume_note(4, long_warmup, long_warmup, 8) == ("the learning rate continues its schedule from 0.0003: "
                                                           "rises to 0.00048 at step 8, still warming up "
                                                           "(optim.warmup_steps=50)")
    assert resume_note(4, long_warmup, long_warmup, 60) == ("the learning rate continues its schedule from 0.0003: "
                                                            "rises to 0.003 at step 50, then stays at 0.003 to step "
                                                            "60 (no room to decay)")
    stretched = Schedule(peak=3e-3, floor=3e-4, warmup_steps=50, decay_steps=100)
    assert resume_note(4, stretched, stretched, 20).endswith("rises to 0.0012 at step 20, still warming up "
                                                             "(optim.warmup_steps=50)")


def train(*args, cwd):
    result = subprocess.run([sys.executable, "-m", "lmforge", "train", "--no-progress", *args],
                            capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result


def logged_rates(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def test_extending_a_run_keeps_its_past_and_says_what_the_rate_will_do(tmp_path, corpus_dir, data_dir):
    """Train 6 steps, then extend to 9: the schedule's length was fixed at 6 when the run started,
    so steps 7-9 train at the floor; extending again with optim.decay_steps=12 re-stretches it
    and says that the rate jumps. The logged rate of step k is the schedule's value at k - 1."""
    run = tmp_path / "run"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=6, log_interval=1, eval_interval=0,
                               checkpoint_interval=0)
    train("--model", "tiny", "--out", str(run), "optim.lr=1e-3", *overrides, cwd=tmp_path)
    schedule = Schedule(peak=1e-3, floor=1e-4, warmup_steps=2, decay_steps=6)
    assert "decay_steps: 6" in (run / "config.yaml").read_text()

    resumed = train("--resume", str(run), "train.max_steps=9", cwd=tmp_path)
    first_line = resumed.stdout.strip().splitlines()[0]
    assert first_line == (f"resuming {run} at step 6 (step_0000006): the schedule ended at step 6: the learning "
                          f"rate stays at its floor 0.0001 to step 9 (set optim.decay_steps to stretch it)")
    rates = logged_rates(run)
    assert [rates[k] for k in range(1, 10)] == pytest.approx([schedule(k - 1) for k in range(1, 10)], rel=1e-12)
    assert rates[7] == rates[8] == rates[9] == pytest.approx(1e-4, rel=1e-12)

    resumed = train("--resume", str(run), "train.max_steps=12", "optim.decay_steps=12", cwd=tmp_path)
    stretched = Schedule(peak=1e-3, floor=1e-4, warmup_steps=2, decay_steps=12)
    assert resumed.stdout.strip().splitlines()[0].startswith(
        f"resuming {run} at step 9 (step_0000009): the learning rate jumps from 0.0001 to {stretched(9):.3g} "
        f"(optim.decay_steps 6 -> 12)")
    rates = logged_rates(run)
    assert [rates[k] for k in (10, 11, 12)] == pytest.approx([stretched(k - 1) for k in (10, 11, 12)], rel=1e-12)
    assert rates[10] > rates[9]
