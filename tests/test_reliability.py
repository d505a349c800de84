"""The run lifecycle under real conditions: signals, a second process, a full disk, bad files.

The subprocess tests run the real CLI (`python -m lmforge`) on the tiny preset. Every wait has a
deadline, so a test that goes wrong fails instead of hanging; no assertion depends on timing.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.data.prepare import open_prepared, prepare_data
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.common.folders import FolderLock, lock_path
from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints, verify_checkpoint
from lmforge.train.signals import StopRequests, Stopped
from tests.conftest import tiny_overrides

DEADLINE_S = 180  # for any one wait; generous for a loaded 2-core machine


def lmforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=DEADLINE_S)


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmforge", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"lmforge exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            pytest.fail(f"no {what} within {DEADLINE_S} s")
        time.sleep(0.1)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.endswith("}") and "train_loss" in line]


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"lmforge did not exit within {DEADLINE_S} s")
    return proc.returncode, out, err


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


STOPPED = re.compile(r"^lmforge: stopped by (SIGTERM|SIGINT) at step (\d+); saved (\S+); "
                     r"continue with: lmforge train --resume (\S+)$")


def test_sigterm_saves_and_says_how_to_resume_and_a_second_writer_is_refused(tmp_path, corpus_dir, data_dir):
    run = tmp_path / "run"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=1000, log_interval=1, eval_interval=1000,
                               checkpoint_interval=1000)
    proc = start("train", "--model", "tiny", "--out", str(run), "--no-progress", *overrides)
    wait_until(proc, lambda: logged_steps(run), "first logged step")

    second = lmforge("train", "--resume", str(run), "--no-progress")
    assert second.returncode == 2
    assert one_line(second.stderr) == (f"lmforge: error: {run} is locked by process {proc.pid} (training; lock "
                                       f"file {lock_path(run)}): wait for it to finish, or stop it, and run again")

    os.kill(proc.pid, signal.SIGTERM)
    status, _, err = finish(proc)
    assert status == 143, err
    name, step, saved, resume = STOPPED.match(one_line(err)).groups()
    step = int(step)
    assert name == "SIGTERM" and step >= 1 and resume == str(run)
    assert Path(saved) == run / "checkpoints" / f"step_{step:07d}"
    verify_checkpoint(Path(saved))
    assert not lock_path(run).exists()  # released, and the file removed (the next test resumes a run)


def test_kill_9_leaves_no_stale_lock_and_ctrl_c_saves(tmp_path, corpus_dir, data_dir):
    run = tmp_path / "run"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=1000, log_interval=1, eval_interval=1000,
                               checkpoint_interval=2)
    proc = start("train", "--model", "tiny", "--out", str(run), "--no-progress", *overrides)
    wait_until(proc, lambda: list_checkpoints(run), "first checkpoint")
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    assert lock_path(run).exists()  # the file stays behind; its lock died with the process

    first = int(find_checkpoint(run).name.removeprefix("step_"))
    killed_metrics = (run / "metrics.jsonl").stat().st_ino  # it may log steps past `first`: not ours

    def resumed_a_step():  # the resume replaces metrics.jsonl (a new file) with the records up to `first`
        metrics = run / "metrics.jsonl"
        return metrics.stat().st_ino != killed_metrics and any(s > first for s in logged_steps(run))

    proc = start("train", "--resume", str(run), "--no-progress")
    wait_until(proc, resumed_a_step, "a step after the resume")
    os.kill(proc.pid, signal.SIGINT)
    status, _, err = finish(proc)
    assert status == 130, err
    name, step, saved, _ = STOPPED.match(one_line(err)).groups()
    assert name == "SIGINT" and int(step) > first
    assert find_checkpoint(run) == Path(saved)


def test_a_second_ctrl_c_interrupts_at_once():
    previous = signal.getsignal(signal.SIGINT)
    with StopRequests() as stop:
        signal.raise_signal(signal.SIGINT)  # the handler runs before raise_signal returns
        assert stop.received == signal.SIGINT
        signal.raise_signal(signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


REPORTING_RANK = """
import os, signal, sys
from lmforge.train.signals import StopRequests
try:
    with StopRequests():
        raise RuntimeError("a peer died")
except RuntimeError:
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent, the moment it sees the peer die
    print("lmforge: error: the peer died", file=sys.stderr, flush=True)
    sys.exit(2)
"""


def test_a_rank_reporting_an_error_under_torchrun_outlives_the_agents_sigterm():
    """A real process, a real SIGTERM after the block is left on an error: under torchrun (WORLD_SIZE
    set) the error is still said and the exit status is the error's; alone, SIGTERM kills as usual."""
    under_torchrun = subprocess.run([sys.executable, "-c", REPORTING_RANK], capture_output=True, text=True,
                                    env={**os.environ, "WORLD_SIZE": "2"}, timeout=60)
    assert (under_torchrun.returncode, under_torchrun.stderr) == (2, "lmforge: error: the peer died\n")
    alone = subprocess.run([sys.executable, "-c", REPORTING_RANK], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, timeout=60)
    assert alone.returncode == -signal.SIGTERM


def test_a_stop_leaves_the_handlers_as_they_were_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped):
        with StopRequests():
            raise Stopped(signal.SIGTERM, 3, None)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_one_prepare_per_data_folder_and_a_killed_ones_leftovers_are_removed(tmp_path, corpus_dir):
    data = tmp_path / "prep"
    leftover = tmp_path / ".prep.partial-999999"  # what a prepare killed by SIGKILL leaves
    leftover.mkdir()
    (leftover / "train.bin").write_bytes(b"\0" * 10)
    overrides = tiny_overrides(corpus_dir, data)
    with FolderLock(data, "preparing data"):  # this test process is the first writer
        result = lmforge("prepare", "--model", "tiny", *overrides)
    assert result.returncode == 2
    assert one_line(result.stderr).startswith(f"lmforge: error: {data} is locked by process {os.getpid()} "
                                              f"(preparing data;")
    assert not data.exists() and leftover.exists()

    result = lmforge("prepare", "--model", "tiny", *overrides)
    assert result.returncode == 0, result.stderr
    assert not leftover.exists() and not lock_path(data).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 2.5 MB file system: room for the run folder and one tiny checkpoint (1.6 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); "
                    f"test_checkpoint.py's ENOSPC test covers the save in-process")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint_and_the_run_continues(small_disk, corpus_dir, data_dir):
    run = small_disk / "run"
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=4, checkpoint_interval=2, eval_interval=2)
    result = lmforge("train", "--model", "tiny", "--out", str(run), "--no-progress", *overrides)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert line.startswith(f"lmforge: error: checkpoint {run}/checkpoints/step_0000004 could not be written (")
    assert "No space left on device" in line
    assert line.endswith(f"its partial folder is removed and the last good checkpoint is kept: "
                         f"{run}/checkpoints/step_0000002; make room, and continue with lmforge train --resume "
                         f"{run}. An update that grew huge without turning into inf/NaN cannot be told apart "
                         f"afterwards: if that checkpoint's loss looks wrong, delete it to resume from an "
                         f"earlier one with a lower optim.lr")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002"]

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # room made
    result = lmforge("train", "--resume", str(run), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_os_errors_are_one_line(tmp_path, corpus_dir, data_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    overrides = tiny_overrides(corpus_dir, data_dir)
    assert main(["train", "--model", "tiny", "--out", "a-file/run", "--no-progress", *overrides]) == 2
    assert one_line(capsys.readouterr().err) == ("lmforge: error: a-file is a file, not a folder: pick another "
                                                 "--out or --name")
    assert main(["train", "--model", "tiny", "--out", "a-file", "--no-progress", *overrides]) == 2
    assert one_line(capsys.readouterr().err) == ("lmforge: error: a-file is a file, not a folder: pick another "
                                                 "--out or --name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_plan_into_a_closed_pipe_stops_quietly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "plan", "--model", "tiny", "--hardware", "a100",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before lmforge writes a byte: `lmforge plan --json | head -0`
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert err == "" and proc.returncode == 128 + signal.SIGPIPE


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "tiny", "--hardware", "a100", "--plot", "/no/such/dir/p.png"],
     "--plot /no/such/dir/p.png: folder /no/such/dir does not exist; create it or pick another path"),
    (["plan", "--model", "tiny", "--hardware", "a100", "--seq-len", "65"],
     "--seq-len 65 is beyond the model's 64 positions: lower it, or add model.max_seq_len=65"),
    (["generate", "--run", "runs/none", "--device", "gpu"],
     "--device=gpu is not a device: use auto, cpu, cuda or cuda:N"),
    (["generate", "--run", "runs/none", "--device", "mps"],
     "--device=mps: lmforge runs on cpu or cuda; use auto, cpu, cuda or cuda:N"),
    pytest.param(["generate", "--run", "runs/none", "--device", "cuda"],
                 "--device=cuda but no CUDA device is available: use cpu (or auto)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_more_user_errors_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert one_line(capsys.readouterr().err) == f"lmforge: error: {message}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, message", [
    (["model.attention=flash_triton"], "attention backend 'flash_triton' "),
    (["model.attention=flash_torch", "model.dropout=0.1"],
     "model.attention=flash_torch does not support attention dropout (model.dropout=0.1)"),
    (["optim.lr=3.3e38", "optim.warmup_steps=0"], "optim.lr=3.3e+38 overflows fp32 in AdamW's first step"),
])
def test_training_errors_are_found_before_the_run_folder_is_written(tmp_path, corpus_dir, data_dir, capsys,
                                                                     monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # flash_triton on CPU needs it: here it is missing
    if "model.attention=flash_triton" in extra:
        import lmforge.kernels.flash_triton as flash_triton

        monkeypatch.setattr(flash_triton, "triton_installed", lambda: False)
    assert main(["train", "--model", "tiny", "--no-progress", *tiny_overrides(corpus_dir, data_dir), *extra]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"lmforge: error: {message}")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def data_copy(tmp_path, corpus_dir, data_dir) -> Path:
    prepare_data(make_config("tiny", overrides=tiny_overrides(corpus_dir, data_dir)), log=lambda _: None)
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    return copy


def test_token_ids_beyond_the_vocabulary_are_found_when_the_file_is_opened(data_copy):
    tokens = np.memmap(data_copy / "val.bin", dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = 600  # the tokenizer has 512 tokens
    tokens.flush()
    del tokens
    with pytest.raises(LmforgeError, match=r"val.bin holds token id 600, but its tokenizer has 512 tokens: the "
                                           r"file is corrupt; delete \S+ and prepare the data again$"):
        open_prepared(data_copy)


def test_meta_json_without_a_key_is_refused_when_read(data_copy):
    meta = json.loads((data_copy / "meta.json").read_text())
    del meta["tokenizer_vocab_size"]
    (data_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LmforgeError, match=r"meta.json lacks 'tokenizer_vocab_size': it is incomplete"):
        open_prepared(data_copy)
    del meta["splits"]["val"]["bytes"]
    meta["tokenizer_vocab_size"] = 512
    (data_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LmforgeError, match=r"meta.json lacks 'splits.val.bytes'"):
        open_prepared(data_copy)


def test_a_tokenizer_smaller_than_the_model_vocabulary_is_reported(tmp_path, capsys, monkeypatch):
    # 40 short documents: too little text for a byte-level BPE to learn 2048 tokens
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 8)
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus, tmp_path / "data", max_steps=1, eval_batches=1, checkpoint_interval=1)
    assert main(["train", "--model", "tiny", "--out", "run", "--no-progress", "model.vocab_size=2048",
                 "train.seq_len=16", *overrides]) == 0
    vocab = json.loads((tmp_path / "data" / "meta.json").read_text())["tokenizer_vocab_size"]
    assert vocab < 2048
    assert (f"warning: the tokenizer in {tmp_path / 'data'} has {vocab} tokens, model.vocab_size is 2048: the other "
            f"{2048 - vocab} embedding rows are never used") in " ".join(capsys.readouterr().out.split())
