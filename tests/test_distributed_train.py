"""`lmforge train` under torchrun: real processes on gloo, the tiny model, a few steps.

Checked here: N ranks with batch B train as one process with batch N*B; rank 0 alone writes the
run's files; a distributed checkpoint saved by 2 ranks resumes on 2 bit for bit and on 1 and 3 to
the same numbers; a rank killed with SIGKILL makes the others stop with one line naming it, and
the run resumes; `lmforge train --nproc 2` is the same launch.

Tolerance against a different number of ranks (fp32): the ranks' gradients are averaged as
(g_0 + g_1) / 2 of per-rank means where one process takes one mean over all rows, so each step's
gradient differs in the last bits (relative 1e-7); AdamW divides by sqrt(v), so a parameter moves
by at most ~lr per step whatever its gradient's size, and six steps at lr 1e-3 keep the
difference well under 1e-5 absolute; a wrong batch slice (other rows) or an unaveraged gradient
moves the parameters by ~lr = 1e-3 and the losses in the second decimal.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints
from lmforge.runs.checkpoint.read import load_model_weights
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.dist

STEPS = 6
TIMEOUT = 240  # seconds any launch may take before the test fails (it never hangs the suite)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "-m", "lmforge", "train", "--no-progress", *args]


def run(command, cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def settings(corpus_dir, data_dir):
    """Overrides of the runs compared here: 6 steps, the schedule fixed at 6 steps (so that a run
    of 3 extended to 6 is the run of 6), evaluation and a checkpoint at step 3, dropout off."""
    def build(batch_size: int, max_steps: int = STEPS, **train):
        train = {"eval_interval": 3, "checkpoint_interval": 3, "log_interval": 1, **train}
        return [*tiny_overrides(corpus_dir, data_dir, max_steps=max_steps, batch_size=batch_size, **train),
                f"optim.decay_steps={STEPS}", "optim.lr=1e-3"]
    # prepare the data once, in this process, so that the launches below only read it
    from lmforge.data.prepare import prepare_data
    prepare_data(make_config("tiny", overrides=build(6)), log=lambda _: None, progress=False)
    return build


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    path = find_checkpoint(run_dir)
    model = Transformer(make_config("tiny").model)
    load_model_weights(model, path)
    return model.state_dict()


def losses(run_dir) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss", r.get("val_loss"))) for r in records]


def assert_close_runs(a, b, atol):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=atol, msg=name)
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb]
    for (step, x), (_, y) in zip(la, lb):
        assert abs(x - y) <= 1e-5, (step, x, y)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, settings):
    """The reference: one process, batch 6, six steps."""
    cwd = tmp_path_factory.mktemp("one")
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(6), "--out", "run"], cwd)
    return cwd / "run"


def test_two_ranks_train_as_one_process_with_their_global_batch_and_rank_0_alone_writes(
        tmp_path, settings, one_process):
    result = run(torchrun(2, "--model", "tiny", *settings(3), "train.parallel=ddp", "--out", "run"), tmp_path)
    run_dir = tmp_path / "run"
    assert_close_runs(run_dir, one_process, atol=1e-5)
    # rank 0 alone prints and logs: one plan, one summary, each record once
    assert result.stdout.count("lmforge train: plan") == 1 and result.stdout.count("lmforge train: summary") == 1
    steps = [s for s, _ in losses(run_dir)]
    assert steps == [1, 2, 3, 3, 4, 5, 6, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_trained"] == STEPS * 6 * 64  # all ranks: 2 x 3 windows of 64 tokens per step
    # one distributed checkpoint: each rank wrote its file of the model and optimizer folders
    path = find_checkpoint(run_dir)
    assert {p.name for p in (path / "model").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert json.loads((path / "state.json").read_text())["world_size"] == 2


def test_eval_batch_size_is_rows_per_replica_as_batch_size_is(tmp_path, settings, one_process):
    """train.eval_batch_size under 2 ranks validates on the windows one process of twice the rows does."""
    def val_losses(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]

    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(6, max_steps=3),
         "train.eval_batch_size=4", "--out", "one"], tmp_path)
    run(torchrun(2, "--model", "tiny", *settings(3, max_steps=3), "train.parallel=ddp", "train.eval_batch_size=2",
                 "--out", "two"), tmp_path)
    [(step, one)], [(_, two)] = val_losses(tmp_path / "one"), val_losses(tmp_path / "two")
    assert step == 3 and abs(one - two) <= 1e-5
    assert abs(one - dict(val_losses(one_process))[3]) > 1e-4  # 4 rows, not the batch's 6: other windows


def test_a_checkpoint_of_2_ranks_resumes_on_2_bit_for_bit_and_on_1_and_3_to_the_same_numbers(
        tmp_path, settings, one_process):
    import shutil

    straight = tmp_path / "straight"
    run(torchrun(2, "--model", "tiny", *settings(3), "train.parallel=ddp", "--out", str(straight)), tmp_path)
    # `lmforge train --nproc 2` is the same launch, through torchrun's launcher API
    saved = tmp_path / "saved"
    run([sys.executable, "-m", "lmforge", "train", "--nproc", "2", "--no-progress", "--model", "tiny",
         *settings(3, max_steps=3), "train.parallel=ddp", "--out", str(saved)], tmp_path)
    assert [p.name for p in list_checkpoints(saved)] == ["step_0000003"]
    for ranks in (2, 1, 3):
        resumed = tmp_path / f"on{ranks}"
        shutil.copytree(saved, resumed)
        batch = f"train.batch_size={6 // ranks}"
        if ranks == 1:
            command = [sys.executable, "-m", "lmforge", "train", "--no-progress"]
            extra = ["train.parallel=none"]  # one process
        else:
            command = torchrun(ranks)
            extra = ["train.parallel=ddp"]
        run([*command, "--resume", str(resumed), f"train.max_steps={STEPS}", batch, *extra], tmp_path)
        if ranks == 2:  # the same world size: bit for bit
            assert_close_runs(resumed, straight, atol=0)
        else:
            assert_close_runs(resumed, one_process, atol=1e-5)


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker of `rank` started by the torchrun process `launcher_pid`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return None


def kill_rank_after_first_checkpoint(command: list[str], run_dir, cwd, rank: int = 1) -> list[str]:
    """Start `command` (a torchrun launch writing `run_dir`), SIGKILL `rank` once a checkpoint is
    written, and return the launch's "lmforge: error:" lines (it must fail, and always ends)."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list_checkpoints(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the deadline"
            time.sleep(0.2)
        victim = rank_pid(proc.pid, rank)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("lmforge: error:")]
    assert errors, stderr[-12000:]
    return errors


def test_a_killed_rank_stops_the_others_with_one_line_and_the_run_resumes(tmp_path, settings):
    run_dir = tmp_path / "run"
    errors = kill_rank_after_first_checkpoint(
        torchrun(2, "--model", "tiny", *settings(3, max_steps=100_000, checkpoint_interval=2),
                 "train.parallel=ddp", "train.dist_timeout=30", "--out", str(run_dir)), run_dir, tmp_path)
    assert len(errors) == 1, errors
    assert errors[0].startswith("lmforge: error: rank 1 stopped answering (died or hangs); rank 0 stops too")
    # the run continues from its last checkpoint
    step = int(find_checkpoint(run_dir).name.split("_")[1])
    run(torchrun(2, "--resume", str(run_dir), f"train.max_steps={step + 2}", "train.parallel=ddp"), tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == step + 2


def test_a_sharded_run_checkpoints_through_its_engine_and_resumes_on_another_strategy(tmp_path, settings, one_process):
    """ZeRO-3 on 2 ranks saves full tensors by name (gathered from the shards); the checkpoint
    resumes in one process and under FSDP2 on 2 ranks, to the numbers of one process throughout.
    Tolerance: as in tests/test_parallel_engines.py, reduce-scatter sums in another order than one
    process's mean, and where a gradient element is a cancellation near zero AdamW's sign-sized
    update can flip: losses agree to 1e-5, and at most 0.1% of the weights differ by more than
    1e-6, none by more than 2 lr per step (a missing average or a wrong shard moves most weights
    by about lr, and the losses in the second decimal)."""
    import shutil

    saved = tmp_path / "saved"
    run(torchrun(2, "--model", "tiny", *settings(3, max_steps=3), "train.parallel=zero3", "--out", str(saved)),
        tmp_path)
    for name, command, extra in (("one", [sys.executable, "-m", "lmforge", "train", "--no-progress"],
                                  ["train.batch_size=6", "train.parallel=none"]),
                                 ("fsdp", torchrun(2), ["train.batch_size=3", "train.parallel=fsdp"])):
        resumed = tmp_path / name
        shutil.copytree(saved, resumed)
        run([*command, "--resume", str(resumed), f"train.max_steps={STEPS}", *extra], tmp_path)
        la, lb = losses(resumed), losses(one_process)
        assert [s for s, _ in la] == [s for s, _ in lb]
        assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(la, lb)), (la, lb)
        wa, wb = final_weights(resumed), final_weights(one_process)
        diff = torch.cat([(wa[n] - wb[n]).abs().flatten() for n in wa])
        assert diff.max() <= 2 * STEPS * 1e-3 and (diff > 1e-6).float().mean() <= 1e-3, (name, diff.max())
