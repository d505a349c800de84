"""`lmforge runs`: the runs of a folder listed with their settings, progress, loss, speed and status."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from lmforge.cli import main
from lmforge.runs.metrics import read_metrics
from tests.conftest import tiny_overrides


def lmforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, corpus_dir, data_dir):
    """A finished tiny run `done`, a copy `stopped` whose extension to 20 steps stopped (its summary covers
    8 steps, its last metrics line torn by a kill), and a copy of that, `busy`, whose lock a live process
    holds (as a training process does)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "--model", "tiny", "--out", str(root / "done"), "--no-progress",
                 *tiny_overrides(corpus_dir, data_dir)]) == 0
    shutil.copytree(root / "done", root / "stopped")
    config = yaml.safe_load((root / "stopped" / "config.yaml").read_text())
    config["train"]["max_steps"] = 20
    (root / "stopped" / "config.yaml").write_text(yaml.safe_dump(config))
    with open(root / "stopped" / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "train_loss": 3.')
    shutil.copytree(root / "stopped", root / "busy")
    (root / "not-a-run").mkdir()
    return root


def test_runs_lists_settings_progress_loss_and_status(runs_dir):
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from lmforge.common.folders import FolderLock
lock = FolderLock({str(runs_dir / 'busy')!r}, "training")
print("locked", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = lmforge("runs", str(runs_dir))
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("─")) + 1:]
    rows = {line.split()[0]: line.split() for line in body if line.strip()}
    assert set(rows) == {"busy", "done", "stopped"}  # a folder without config.yaml is not a run
    val_loss = [r["val_loss"] for r in read_metrics(runs_dir / "done" / "metrics.jsonl") if "val_loss" in r][-1]
    summary = json.loads((runs_dir / "done" / "summary.json").read_text())
    # run, model, params, precision, batch, steps "/" max, val loss, tokens/s, MFU, status
    assert rows["done"] == ["done", "tiny", "0.13M", "fp32", "4x64", "8", "/", "8", f"{val_loss:.4f}",
                            f"{summary['tokens_per_s']:,.0f}", f"{summary['mfu']:.1%}", "finished"]
    assert rows["stopped"][5:8] == ["8", "/", "20"] and rows["stopped"][-1] == "stopped"
    assert rows["busy"][-1] == "running"
    # the lock died with its process
    assert lmforge("runs", str(runs_dir / "busy")).stdout.split()[-1] == "stopped"


def test_runs_plot_draws_named_runs_and_rejects_unknown_ones(runs_dir, tmp_path):
    png = tmp_path / "cmp.png"
    result = lmforge("runs", str(runs_dir), "--plot", "done", str(runs_dir / "stopped"), "--out", str(png))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = lmforge("runs", str(runs_dir), "--plot", "done", "nope", "--out", str(tmp_path / "x.png"))
    assert result.returncode == 2
    expected = f"lmforge: error: nope is not a run: give run folders, or names of runs in {runs_dir}"
    assert result.stderr.strip() == expected
    assert not (tmp_path / "x.png").exists()


def test_runs_in_a_missing_or_empty_folder(tmp_path):
    result = lmforge("runs", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "no folder" in result.stderr
    result = lmforge("runs", str(tmp_path))
    assert result.returncode == 0 and f"no runs in {tmp_path}" in result.stdout


def test_a_run_without_a_summary_is_counted_from_its_checkpoint_without_torch(runs_dir, tmp_path):
    """A killed run has no summary.json: its parameter count comes from the newest checkpoint's
    state.json, so listing it loads no torch."""
    run = tmp_path / "killed"
    shutil.copytree(runs_dir / "done", run)
    parameters = json.loads((run / "summary.json").read_text())["parameters"]
    (run / "summary.json").unlink()
    code = f"""
import sys
from lmforge.runs.listing import find_runs
(found,) = find_runs({str(tmp_path)!r})
print(found.parameters, "torch" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(parameters), "False"]
