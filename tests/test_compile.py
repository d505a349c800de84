"""train.compile (wrap.py): compiled blocks and loss give the eager model's numbers under
canonical names; a compiled run resumes bit for bit. A cold compile costs 12-17 s on an idle
2-core CPU, so one test runs by default and the rest are `slow`."""

import pytest
import torch

from lmforge.config import make_config
from lmforge.common.errors import LmforgeError
from lmforge.model.names import canonical_name
from lmforge.train.setup import build


def test_compiled_blocks_and_loss_match_eager_under_canonical_names():
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    overrides = ["train.loss_chunk_tokens=50"]
    torch.manual_seed(0)
    eager, _ = build(make_config("tiny", overrides=overrides))
    torch.manual_seed(0)
    compiled, _ = build(make_config("tiny", overrides=[*overrides, "train.compile=true"]))
    assert "OptimizedModule" in str(compiled) and "OptimizedModule" not in str(eager)
    # checkpoints and optimizer state see the names of the uncompiled model
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert [canonical_name(n) for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    compiled.load_state_dict(eager.state_dict())

    tokens, targets = torch.randint(0, 512, (2, 4, 64))
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    # inductor fuses and reorders fp32 arithmetic: equal to a few roundings, not bit for bit
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert ((p.grad - q.grad).norm() / p.grad.norm()).item() < 1e-4, name
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs == 2  # one for all the blocks, one for the loss piece
    with torch.no_grad():  # evaluation and generation run eagerly: no compile for them
        assert compiled(tokens, targets).item() == eager(tokens, targets).item()
        compiled(tokens[:, :5])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_flash_triton_is_refused_with_compile():
    with pytest.raises(LmforgeError, match="train.compile=true with model.attention=flash_triton"):
        make_config("tiny", overrides=["train.compile=true", "model.attention=flash_triton"])


def test_a_compiled_run_resumes_bit_for_bit(corpus_dir, data_dir, tmp_path):
    """train.compile on both sides of a resume, each run in a process of its own as users run
    them (a fresh compile after the restart): parameters, optimizer state and the logged losses
    equal an uninterrupted compiled run's, bit for bit."""
    import json
    import subprocess
    import sys

    from lmforge.runs.checkpoint.find import find_checkpoint
    from lmforge.runs.checkpoint.read import read_tensors
    from tests.conftest import tiny_overrides

    common = [*tiny_overrides(corpus_dir, data_dir, max_steps=4, checkpoint_interval=2, log_interval=1,
                              eval_interval=0), "train.compile=true", "train.precision=bf16-mixed",
              "optim.decay_steps=4", "train.tensorboard=false"]

    def lmforge(*args):
        result = subprocess.run([sys.executable, "-m", "lmforge", "train", "--no-progress", *args], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]

    lmforge("--model", "tiny", *common, "--out", "straight")
    lmforge("--model", "tiny", *common, "train.max_steps=2", "--out", "cut")
    lmforge("--resume", "cut", "train.max_steps=4")
    for folder in ("model", "optimizer"):
        a, b = (read_tensors(find_checkpoint(tmp_path / run), folder) for run in ("straight", "cut"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
    assert "_orig_mod" not in " ".join(a)
    losses = [[r["train_loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
               if "train_loss" in r] for run in ("straight", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 4