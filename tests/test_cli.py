import json
import subprocess
import sys

import pytest

from lmforge.cli import main
from tests.conftest import tiny_overrides


def lmforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd)


def test_help_lists_commands_and_presets():
    result = lmforge("--help")
    assert result.returncode == 0
    for word in ("prepare", "train", "generate", "gpt2-124m", "llama3-70b"):
        assert word in result.stdout


@pytest.mark.parametrize("args, message", [
    (["train", "model.n_layer=3"], "command line: unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)"),
    (["train", "--model", "gpt5"], "unknown model preset 'gpt5' (did you mean 'gpt3-175b'?); presets: tiny, small, "
                                   "gpt2-124m, gpt2-350m, gpt3-175b, llama3-1b, llama2-7b, llama3-8b, llama3-70b"),
    (["train", "data.source=/no/such/corpus.txt"], "data source /no/such/corpus.txt does not exist: give .txt/.jsonl "
                                                   "files or folders, or 'stdlib'"),
    (["generate", "--run", "runs/none", "--prompt", "x"], "runs/none does not exist: give an lmforge run folder (config.yaml, "
                  "checkpoints/) or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"),
])
def test_user_errors_are_one_line_with_exit_code_2(tmp_path, args, message):
    result = lmforge(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr == f"lmforge: error: {message}\n"
    assert not (tmp_path / "runs").exists()


def test_train_then_generate_end_to_end(tmp_path, corpus_dir, data_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=200, eval_interval=100, checkpoint_interval=100,
                               sample_tokens=30, batch_size=8)
    assert main(["train", "--model", "tiny", "--name", "t1", "--no-progress", "optim.lr=1e-2", *overrides]) == 0
    run = tmp_path / "runs" / "t1"
    for name in ("config.yaml", "tokenizer.json", "metrics.jsonl", "loss.png", "summary.json", "sample.txt"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["tokens_trained"] == 200 * 8 * 64
    # it learned: well below the loss of the best context-free model
    assert summary["val_loss"] < summary["unigram_entropy_nats"] - 0.3
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "validation loss" in out and "unigram entropy" in out
    # the sample continues the start of a validation document (train.sample_prompt's default)
    sample, prompt = (run / "sample.txt").read_text(), summary["sample_prompt"]
    assert prompt and any(path.read_text().startswith(prompt) for path in corpus_dir.glob("*.py"))
    assert sample.startswith(prompt) and len(sample.removeprefix(prompt).strip()) >= 10  # the model wrote text

    assert main(["generate", "--run", str(run), "--prompt", "import ", "--max-new-tokens", "20",
                 "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    samples = out.split("--- sample 2 ---\n")
    assert len(samples) == 2 and samples[0].startswith("--- sample 1 ---\nimport ")
    for text in (samples[0].removeprefix("--- sample 1 ---\n"), samples[1]):
        assert text.startswith("import ") and len(text.removeprefix("import ").strip()) >= 10

    # resume may extend training, but not change the model
    assert main(["train", "--resume", str(run), "model.d_model=32"]) == 2
    assert "cannot change model.d_model when resuming" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "optim.name=lion"]) == 2  # its checkpoint holds AdamW's states
    assert capsys.readouterr().err == (f"lmforge: error: cannot change optim.name when resuming: {run} holds the "
                                       f"states of optim.name=adamw; start a new run (or finetune {run}) for lion\n")
    assert main(["train", "--resume", str(run), "--no-progress", "train.max_steps=210"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 210


def test_prepare_command_and_a_truncated_token_file(tmp_path, corpus_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus_dir, tmp_path / "prep")
    assert main(["prepare", "--model", "tiny", *overrides]) == 0
    assert "train.bin" in capsys.readouterr().out
    train_bin = tmp_path / "prep" / "train.bin"
    size = train_bin.stat().st_size
    with open(train_bin, "r+b") as f:
        f.truncate(size - 10)
    assert main(["train", "--model", "tiny", "--no-progress", *overrides]) == 2
    assert "train.bin is truncated or corrupt" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_vocab_mismatch_between_tokenizer_and_model(tmp_path, corpus_dir, data_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus_dir, data_dir)
    assert main(["prepare", "--model", "tiny", *overrides]) == 0
    # the same folder read with another vocabulary size is refused, not silently reused
    assert main(["train", "--model", "tiny", *overrides, "model.vocab_size=300"]) == 2
    assert "prepared with a different vocab_size" in capsys.readouterr().err
