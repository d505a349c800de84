"""Data parallelism without processes: the loader's slicing by rank, and the launch checks that stop
a setup that cannot work before any work (lmforge/parallel/world.py). The runs under torchrun are
in test_distributed_train.py (marker `dist`)."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.config import make_config
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.common.errors import LmforgeError
from lmforge.modes import PARALLEL_STRATEGIES, PIPELINE_ENGINES
from lmforge.parallel.parallelize import DATA_PARALLEL_ENGINES, PIPELINE_STAGE_ENGINES
from lmforge.parallel.world import check_launch
from lmforge.parallel.world import env_world

TOKENS = np.arange(10_000, dtype=np.uint16) % 4093


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_together_see_the_batch_of_one_process_with_the_global_batch(world_size):
    for index in (0, 7):
        x, y = window_batch(TOKENS, 4 * world_size, 16, seed=3, index=index)
        parts = [window_batch(TOKENS, 4, 16, seed=3, index=index, rank=r, world_size=world_size)
                 for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert not torch.equal(parts[0][0], parts[1][0])  # distinct rows per rank


def test_one_rank_draws_what_it_always_drew():
    """World size 1 is today's loader bit for bit: the same generator calls."""
    rng = np.random.default_rng([5, 2])
    starts = rng.integers(0, len(TOKENS) - 8, size=3)
    x, _ = window_batch(TOKENS, 3, 8, seed=5, index=2, rank=0, world_size=1)
    assert torch.equal(x, torch.from_numpy(np.stack([TOKENS[s: s + 8] for s in starts]).astype(np.int64)))


def test_the_loader_resumes_on_another_number_of_ranks():
    """Position = global batches handed out: rank 1 of 2 from batch 5 = rows 2:4 of one process's batch 5."""
    with BatchLoader(TOKENS, 4, 8, seed=1, start=5) as whole, \
            BatchLoader(TOKENS, 2, 8, seed=1, start=5, rank=1, world_size=2) as half:
        x_whole, _ = next(whole)
        x_half, _ = next(half)
    assert torch.equal(x_half, x_whole[2:4]) and half.position == whole.position == 6


def cfg(*overrides):
    return make_config("tiny", overrides=list(overrides))


@pytest.mark.parametrize("env, overrides, cuda, message", [
    (None, ["train.parallel=ddp"], 0, "train.parallel=ddp needs one process per device: launch with torchrun"),
    ((0, 2, 0), [], 0, "train.parallel=none under torchrun with 2 processes: choose how they share the work"),
    ((0, 2, 0), ["train.parallel=ddp", "train.device=cuda"], 0, "no CUDA device is available: use train.device=cpu"),
    ((3, 4, 3), ["train.parallel=ddp", "train.device=cuda"], 2, r"LOCAL_RANK 3 but this node has 2 CUDA device\(s\)"),
    ((0, 2, 0), ["train.parallel=ddp", "train.device=cuda:1"], 2, "each rank takes its own GPU"),
])
def test_a_launch_that_cannot_work_is_refused(env, overrides, cuda, message):
    with pytest.raises(LmforgeError, match=message):
        check_launch(cfg(*overrides), env, cuda_devices=cuda)


def test_launches_that_work_get_their_device():
    assert check_launch(cfg(), None, 0) == torch.device("cpu")
    assert check_launch(cfg("train.parallel=ddp"), (1, 2, 1), 0) == torch.device("cpu")  # auto, no GPU: gloo
    assert check_launch(cfg("train.parallel=zero3"), (5, 8, 1), 2) == torch.device("cuda", 1)  # auto: nccl
    assert check_launch(cfg("train.parallel=ddp"), (0, 1, 0), 0) == torch.device("cpu")  # torchrun of one


def test_every_strategy_and_pipeline_engine_has_its_builder():
    assert set(DATA_PARALLEL_ENGINES) | {"none"} == set(PARALLEL_STRATEGIES)
    assert set(PIPELINE_STAGE_ENGINES) == set(PIPELINE_ENGINES)


def test_torchrun_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env_world() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_world() == (1, 2, 1)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(LmforgeError, match="RANK=2, WORLD_SIZE=2, LOCAL_RANK=1 do not fit together"):
        env_world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(LmforgeError, match="must be integers"):
        env_world()


def test_the_command_refuses_a_parallel_run_without_processes_before_any_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--model", "tiny", "train.parallel=ddp", "--out", "run"]) == 2
    assert capsys.readouterr().err == ("lmforge: error: train.parallel=ddp needs one process per device: launch with "
                                       "torchrun --nproc_per_node=N -m lmforge train ... or lmforge train --nproc N ... (or set "
                                       "train.parallel=none for one process)\n")
    assert main(["train", "--model", "tiny", "--nproc", "2", "--out", "run"]) == 2
    assert "--nproc 2 needs a way to share the work: add train.parallel=ddp" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)  # killed long before
"""
RANK = """
import os, sys, time
from lmforge.parallel import faults as world_module
from lmforge.parallel.faults import watch_launcher
from lmforge.parallel.world import World
world = World(rank=0, world_size=2, local_rank=0, device=None, launcher_pid=watch_launcher())
open(sys.argv[1] + ".ready", "w").close()
deadline = time.monotonic() + 60
while not world._launcher_gone() and time.monotonic() < deadline:
    time.sleep(0.05)
with open(sys.argv[1], "w") as f:
    f.write(f"gone={world._launcher_gone()} signalled={bool(world_module._LAUNCHER_DEATH_RECEIVED)}")
"""


def test_a_rank_learns_at_once_that_its_launcher_was_killed(tmp_path):
    """A real SIGKILL to a real parent: the kernel's death signal reaches the child's handler (not
    SIGTERM, which would read as a plain stop request while the parent's threads still exit)."""
    report = tmp_path / "report"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(report)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "report.ready").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        launcher.send_signal(signal.SIGKILL)
        while not report.exists() or not report.read_text():
            assert time.monotonic() < deadline, "the child never saw its launcher die"
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait()
    assert report.read_text() == "gone=True signalled=True"
