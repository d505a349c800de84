"""Trackers: metrics records written as TensorBoard scalars, read back with TensorBoard's own reader."""

import subprocess
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmforge.train.report import Trackers


def read_scalars(run_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def records(steps, offset=0.0):
    for step in steps:
        yield {"step": step, "time": 1.8e9 + step, "train_loss": 5.0 - step / 10 + offset, "lr": 3e-3 * step / 10,
               "grad_norm": 0.5 + step, "tokens_per_s": 1234.5 * step, "mfu": 0.01 * step, "skipped_steps": step // 3,
               "loss_scale": 65536.0, "peak_memory_bytes": 2**30 + step, "note": "text is not a curve"}


def test_records_read_back_as_tensorboard_scalars(tmp_path):
    trackers = Trackers(tmp_path)
    written = list(records(range(1, 6)))
    for record in written:
        trackers.write(record)
    trackers.write({"step": 5, "val_loss": 4.25})
    trackers.close()
    scalars = read_scalars(tmp_path)
    assert set(scalars) == {"train_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "skipped_steps", "loss_scale",
                            "peak_memory_bytes", "val_loss"}
    for record in written:
        for key, value in record.items():
            if key in scalars:  # TensorBoard stores float32
                assert scalars[key][record["step"]] == float(np.float32(value)), key
    assert scalars["val_loss"] == {5: 4.25}


def test_a_resumed_run_replaces_what_the_interrupted_session_logged_after_its_checkpoint(tmp_path):
    first = Trackers(tmp_path)
    for record in records(range(1, 11)):  # killed after step 10; the last checkpoint was step 4
        first.write(record)
    first.close()
    second = Trackers(tmp_path, resume_step=4)
    for record in records(range(5, 8), offset=1.0):
        second.write(record)
    second.close()
    losses = read_scalars(tmp_path)["train_loss"]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7]  # steps 8-10 of the first session are gone
    for step in range(1, 8):
        expected = 5.0 - step / 10 + (1.0 if step > 4 else 0.0)
        assert losses[step] == float(np.float32(expected))


def test_wandb_asked_for_but_not_installed_is_one_line_and_writes_nothing(tmp_path):
    code = f"""
import sys
sys.modules["wandb"] = None  # as if not installed
from lmforge.train.report import Trackers
Trackers({str(tmp_path / 'run')!r}, wandb=True)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "LmforgeError: train.wandb=true but the wandb package is not installed: pip install wandb" in result.stderr
    assert not (tmp_path / "run").exists()


def test_wandb_receives_the_same_scalars(tmp_path, monkeypatch):
    """W&B is optional and not installed here: a stand-in module records what lmforge hands it."""
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    class StandIn:
        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs))
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", StandIn)
    trackers = Trackers(tmp_path / "r1", tensorboard=False, wandb=True, config={"model": {"n_layers": 2}})
    trackers.write({"step": 3, "train_loss": 4.5, "lr": 1e-3, "note": "x"})
    trackers.close()
    assert calls == [("init", dict(project="lmforge", name="r1", dir=str(tmp_path / "r1"),
                                   config={"model": {"n_layers": 2}})),
                     ("log", 3, {"train_loss": 4.5, "lr": 1e-3}), ("finish",)]
