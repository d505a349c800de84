"""Every command names its run the same way: RUN, the first positional argument; the older flags
(`generate --run`, `finetune --base`) and the new `export --run` say the same."""

import json
import subprocess
import sys

import pytest

from lmforge.cli import build_parser, main, parse_args
from lmforge.config import load_config
from tests.conftest import tiny_overrides


def parsed(*argv: str) -> dict:
    return vars(parse_args(build_parser(), list(argv)))


@pytest.mark.parametrize("new, old", [
    (["generate", "runs/r", "--prompt", "x"], ["generate", "--run", "runs/r", "--prompt", "x"]),
    (["generate", "--prompt", "x", "runs/r"], ["generate", "--prompt", "x", "--run", "runs/r"]),
    (["export", "runs/r", "--format", "hf"], ["export", "--run", "runs/r", "--format", "hf"]),
    (["export", "--format", "hf", "runs/r"], ["export", "--format", "hf", "--run", "runs/r"]),
    (["eval-format", "runs/r", "--tasks", "1"], ["eval-format", "--run", "runs/r", "--tasks", "1"]),
    (["finetune", "runs/r", "data.source=a.jsonl", "--lora-rank", "4"],
     ["finetune", "--base", "runs/r", "data.source=a.jsonl", "--lora-rank", "4"]),
    # overrides before RUN, around options: RUN is the first word without '=', the others keep their order
    (["finetune", "data.source=a.jsonl", "runs/r", "--lora-rank", "4", "train.max_steps=3"],
     ["finetune", "data.source=a.jsonl", "--base", "runs/r", "--lora-rank", "4", "train.max_steps=3"]),
    (["finetune", "--lora-rank", "4", "runs/r", "data.source=a.jsonl", "train.max_steps=3"],
     ["finetune", "--lora-rank", "4", "--base", "runs/r", "data.source=a.jsonl", "train.max_steps=3"]),
    (["generate", "runs/r", "--run", "runs/r"], ["generate", "runs/r"]),  # the same run twice is the run
    (["finetune", "runs/r", "--base", "runs/r"], ["finetune", "--base", "runs/r"]),
])
def test_the_positional_run_and_the_old_flag_parse_the_same(new, old):
    assert parsed(*new) == parsed(*old)


def test_what_each_form_parses_to():
    assert parsed("generate", "runs/r")["run"] == "runs/r"
    assert parsed("export", "--run", "runs/r", "--format", "hf")["run"] == "runs/r"
    args = parsed("finetune", "data.source=a.jsonl", "runs/r", "train.max_steps=3")
    assert args["base"] == "runs/r" and args["overrides"] == ["data.source=a.jsonl", "train.max_steps=3"]
    args = parsed("finetune", "--resume", "runs/ft", "train.max_steps=6")  # --resume names no base
    assert args["base"] is None and args["resume"] == "runs/ft" and args["overrides"] == ["train.max_steps=6"]
    assert parsed("runs", "experiments")["dir"] == "experiments" and parsed("runs")["dir"] == "runs"
    assert parsed("train", "--resume", "runs/r")["resume"] == "runs/r"


def lmforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("args, message", [
    (["generate", "runs/a", "--run", "runs/b"], "lmforge generate: error: RUN given twice, as runs/a and as --run "
                                                "runs/b: give it once"),
    (["export", "runs/a", "--run", "runs/b", "--format", "hf"], "lmforge export: error: RUN given twice, as runs/a "
                                                                "and as --run runs/b: give it once"),
    (["finetune", "runs/a", "--base", "runs/b"], "lmforge finetune: error: RUN given twice, as runs/a and as --base "
                                                 "runs/b: give it once"),
])
def test_two_different_runs_are_one_error_line(tmp_path, args, message):
    result = lmforge(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == message + "\n"


@pytest.mark.parametrize("command", [["generate"], ["export", "--format", "hf"], ["eval-format"]])
def test_a_missing_run_is_an_argparse_error(tmp_path, command):
    result = lmforge(*command, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("error: the following arguments are required: RUN")


def test_finetune_without_a_run_says_so(capsys):
    assert main(["finetune", "data.source=a.jsonl"]) == 2
    assert capsys.readouterr().err == ("lmforge: error: lmforge finetune needs RUN (the run folder of the model to "
                                       "fine-tune)\n")


def test_a_run_named_as_a_new_user_would(tmp_path, corpus_dir, data_dir, capsys, monkeypatch):
    """`generate r`, `export --run r` and `finetune r` on a real (tiny) run."""
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=2, eval_interval=2, checkpoint_interval=2)
    assert main(["train", "--model", "tiny", "--out", "r", "--no-progress", *overrides]) == 0
    capsys.readouterr()
    assert main(["generate", "r", "--prompt", "import ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("import ")
    assert main(["export", "--run", "r", "--format", "hf", "--out", "hf"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"def f{n}(x):\n    return x +", "response": f" {n}\n"}) + "\n"
                             for n in range(40)))
    assert main(["finetune", "data.source=pairs.jsonl", "r", "--lora-rank", "4", "--out", "ft", "--no-progress",
                 "train.max_steps=2", "train.batch_size=4", "train.seq_len=24", "train.eval_interval=2",
                 "train.eval_batches=1", "train.checkpoint_interval=2", "train.sample_tokens=0",
                 "optim.warmup_steps=1"]) == 0
    assert (tmp_path / "ft" / "summary.json").is_file()
    # the run records its examples' absolute path: a resume from another folder reads the same file
    assert load_config(tmp_path / "ft" / "config.yaml").data.source == str(pairs)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["finetune", "--resume", str(tmp_path / "ft"), "--no-progress", "train.max_steps=3"]) == 0
    assert list((tmp_path / "elsewhere").iterdir()) == []
