"""`lmforge finetune` under torchrun: real processes on gloo, a tiny base, a few steps.

Checked here: a LoRA and a full fine-tune of a run folder train and save under ddp (and full
fine-tuning under zero1), as one process with their global batch; a LoRA run resumes under
torchrun; a Hugging Face folder is a base under torchrun too. Each launch sets
train.dist_timeout=30, so a rank left waiting (rank 0 reading the base inside World.main_first
while a collective read waits for rank 1: issue 26) fails in seconds instead of hanging.

Tolerance against one process (fp32): as tests/test_distributed_train.py argues, averaged
per-rank gradients differ from one mean in the last bits, and AdamW moves a parameter by at most
~lr per step, so four steps stay well under 1e-5; other rows or an unaveraged gradient move the
losses in the second decimal.
"""

import json
import random
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from lmforge.config import make_config
from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints
from lmforge.runs.checkpoint.read import read_tensors
from lmforge.train.loop import Trainer
from test_distributed_train import env, free_port, losses
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.dist

STEPS = 4
TIMEOUT = 150  # seconds a launch may take before the test fails (dist_timeout=30 stops a hang sooner)


def finetune(cwd, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """`lmforge finetune ARGS` in `cwd`: one process, or `nproc` ranks under torchrun."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                 f"--master_port={free_port()}"] if nproc > 1 else [sys.executable])
    result = subprocess.run([*launcher, "-m", "lmforge", "finetune", "--no-progress", *args], cwd=cwd,
                            capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def settings(batch_size: int, max_steps: int = STEPS) -> list[str]:
    """Overrides of the runs compared here: the schedule fixed at STEPS (a run of 2 resumed to 4
    is the run of 4), evaluation and a checkpoint at step 2, dropout off (ranks draw their own)."""
    train = {"max_steps": max_steps, "batch_size": batch_size, "seq_len": 24, "eval_interval": 2,
             "eval_batches": 2, "checkpoint_interval": 2, "log_interval": 1, "sample_tokens": 0,
             "tensorboard": "false", "dist_timeout": 30}
    return [*(f"train.{k}={v}" for k, v in train.items()), "optim.warmup_steps=1", f"optim.decay_steps={STEPS}",
            "optim.lr=1e-3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus_dir, data_dir):
    """A tiny pretrained run to fine-tune, and prompt/response pairs to fine-tune it on."""
    folder = tmp_path_factory.mktemp("base")
    cfg = make_config("tiny", overrides=tiny_overrides(corpus_dir, data_dir, max_steps=4))
    Trainer(cfg, folder / "base", console=Console(quiet=True), progress=False).run()
    rng = random.Random(0)
    with open(folder / "pairs.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randrange(50), rng.randrange(50)
            f.write(json.dumps({"prompt": f"def f{a}(x):\n    return x +", "response": f" {b}\n"}) + "\n")
    return folder / "base", folder / "pairs.jsonl"


def common(base, corpus_dir, *extra: str) -> list[str]:
    """A fine-tune of the base run on plain text: windows, every token in the loss. (Examples are
    not compared with one process: each rank averages over its own response tokens, so 2 ranks
    differ from one mean over all of them when their rows hold different numbers of targets.)"""
    return ["--base", str(base[0]), f"data.source={corpus_dir}", *extra]


def assert_same_runs(a, b, atol=1e-5):
    """The same losses and final checkpoint (LoRA: its adapters) within `atol`."""
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb]
    for (step, x), (_, y) in zip(la, lb):
        assert abs(x - y) <= atol, (step, x, y)
    wa, wb = read_tensors(find_checkpoint(a)), read_tensors(find_checkpoint(b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=atol, msg=name)


def test_a_lora_finetune_under_torchrun_resumes_and_equals_one_process(base, corpus_dir, tmp_path):
    lora = ["--lora-rank", "4"]
    finetune(tmp_path, *common(base, corpus_dir, *lora, *settings(4)), "--out", "one")
    # 2 ranks of half the batch, stopped after the step-2 checkpoint, then resumed under torchrun
    result = finetune(tmp_path, *common(base, corpus_dir, *lora, *settings(2, max_steps=2)), "train.parallel=ddp",
                      "--out", "two", nproc=2)
    assert result.stdout.count("lmforge train: summary") == 1  # rank 0 alone reports
    assert [p.name for p in list_checkpoints(tmp_path / "two")] == ["step_0000002"]
    finetune(tmp_path, "--resume", "two", f"train.max_steps={STEPS}", "train.dist_timeout=30", nproc=2)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["steps"] == STEPS
    assert_same_runs(tmp_path / "two", tmp_path / "one")
    assert all(name.endswith((".lora_A", ".lora_B")) for name in read_tensors(find_checkpoint(tmp_path / "two")))


@pytest.fixture(scope="module")
def full_one_process(base, corpus_dir, tmp_path_factory):
    """The reference of the full fine-tunes: one process, batch 4."""
    cwd = tmp_path_factory.mktemp("full")
    finetune(cwd, *common(base, corpus_dir, *settings(4)), "--out", "one")
    return cwd / "one"


@pytest.mark.parametrize("parallel", ["ddp", "zero1"])
def test_a_full_finetune_under_torchrun_equals_one_process(base, corpus_dir, tmp_path, full_one_process, parallel):
    finetune(tmp_path, *common(base, corpus_dir, *settings(2)), f"train.parallel={parallel}", "--out", "two", nproc=2)
    assert_same_runs(tmp_path / "two", full_one_process)
    base_weights = read_tensors(find_checkpoint(base[0]))
    tuned = read_tensors(find_checkpoint(tmp_path / "two"))
    assert tuned.keys() == base_weights.keys()  # the whole model, every tensor moved off the base
    assert all(not torch.equal(tuned[name], base_weights[name]) for name in tuned)


def test_a_hugging_face_folder_is_a_base_under_torchrun(base, tmp_path):
    pytest.importorskip("transformers")
    from lmforge.data.corpus import train_tokenizer
    from test_interop import TEXT, VOCAB, hf_model

    tokenizer = train_tokenizer([TEXT * 3, "import os\nclass A(object):\n    pass\n"] * 5, VOCAB)
    hf_model("llama", tmp_path / "hf", tokenizer)
    _, pairs = base
    finetune(tmp_path, "--base", str(tmp_path / "hf"), f"data.source={pairs}", "--lora-rank", "4",
             *settings(2, max_steps=2), "train.seq_len=16", "train.parallel=ddp", "--out", "ft", nproc=2)
    adapters = read_tensors(find_checkpoint(tmp_path / "ft"))
    assert adapters and all(name.endswith((".lora_A", ".lora_B")) for name in adapters)
    assert any(value.abs().max() > 0 for name, value in adapters.items() if name.endswith(".lora_B"))  # it trained
