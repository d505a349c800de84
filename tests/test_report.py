"""What a run reports: metrics.jsonl fields, TensorBoard events, the progress line, and the trainer's
first-step measurement, which leaves nothing behind."""

import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from lmforge.train.loop import Trainer
from lmforge.train.report import format_mfu, metrics_line
from tests.conftest import tiny_overrides

FIELDS = ("step", "train_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "tokens_seen", "skipped_steps",
          "time", "elapsed_s", "peak_memory_bytes")


def test_a_batch_run_logs_every_field_as_a_line_and_to_tensorboard(tmp_path, corpus_dir, data_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "r"
    result = subprocess.run([sys.executable, "-m", "lmforge", "train", "--model", "tiny", "--out", str(run),
                             "--no-progress", *tiny_overrides(corpus_dir, data_dir, max_steps=6, log_interval=2,
                                                              eval_interval=3)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in training] == [2, 4, 6]
    for record in training:
        assert set(FIELDS) <= set(record), set(FIELDS) - set(record)
        assert record["tokens_seen"] == record["step"] * 4 * 64 and record["peak_memory_bytes"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    # with --no-progress, one plain line per record, in the progress bar's order, with an ETA
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ") and "| loss " in line]
    assert len(lines) == 3
    assert re.fullmatch(r"step 2/6 \| loss \d\.\d{4} \| lr \S+ \| grad \S+ \| [\d,]+ tok/s \| MFU \S+ \| "
                        r"mem [\d.,]+ [KMG]iB \| ETA \d+m\d\ds", lines[0]), lines[0]
    # TensorBoard holds the same numbers (as float32) under the same names
    events = EventAccumulator(str(run))
    events.Reload()
    for key in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes",
                "skipped_steps", "tokens_seen"):
        logged = {r["step"]: r[key] for r in records if key in r}
        board = {e.step: e.value for e in events.Scalars(key)}
        assert board == pytest.approx(logged, rel=1e-6), key


def test_the_metrics_line_reads_in_torchtitans_order():
    record = {"step": 10, "train_loss": 3.21, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 4023.4, "mfu": 0.79,
              "peak_memory_bytes": 3 * 2**30, "loss_scale": 65536.0}
    assert metrics_line(record) == ("loss 3.2100 | lr 3.00e-04 | grad 0.5 | 4,023 tok/s | MFU 79% | mem 3.00 GiB | "
                                    "scale 65536")
    # a model too small to use the machine shows no MFU rather than "0%"
    assert format_mfu(0.0001) == "-" and format_mfu(0.004) == "0.4%" and format_mfu(0.35) == "35%"


def test_building_a_trainer_changes_nothing_outside_its_run(tiny_config, tmp_path, monkeypatch):
    """No peak cache written (the CLI writes it), and the first-step measuring hooks are gone after
    the run."""
    from lmforge.accounting.hardware import cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = cache_path()
    trainer = Trainer(tiny_config(max_steps=2), tmp_path / "run", console=Console(quiet=True), progress=False)
    assert not cache.exists()
    trainer.run()
    measured = trainer.measurements.first_step
    assert measured["activations"] > 0 and measured["optimizer_states"] > 0
    assert not trainer.model._forward_hooks and not trainer.model._forward_pre_hooks
    assert not trainer.optimizer._optimizer_step_post_hooks
    assert not cache.exists()
