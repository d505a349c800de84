"""The command line as people type it: options and overrides in any order, help without torch,
plan's checks and rows, and the end-of-run sample's default prompt."""

import json
import subprocess
import sys

import pytest

from lmforge.cli import main
from tests.conftest import tiny_overrides


def lmforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd)


def plan_json(capsys, *args) -> dict:
    assert main(["plan", "--hardware", "a100", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_overrides_before_between_and_after_options(capsys):
    plan = plan_json(capsys, "model.n_layers=3", "--model", "tiny", "train.batch_size=2", "--seq-len", "32",
                     "model.d_model=128")
    assert plan["model"]["layers"] == 3 and plan["model"]["d_model"] == 128
    assert plan["setup"]["batch_size"] == 2 and plan["setup"]["seq_len"] == 32
    # typed order is kept: the later of two overrides of one key wins, wherever the options fall
    assert plan_json(capsys, "model.n_layers=3", "--model", "tiny", "model.n_layers=5")["model"]["layers"] == 5
    assert plan_json(capsys, "--model", "tiny", "model.n_layers=3", "--seq-len", "32",
                     "model.n_layers=4")["model"]["layers"] == 4


def test_train_with_an_override_before_the_model_option(tmp_path, corpus_dir, data_dir):
    # the exact shape of the report: key=value, then --model, then key=value
    data, *rest = tiny_overrides(corpus_dir, data_dir, max_steps=1, eval_interval=1, checkpoint_interval=1)
    result = lmforge("train", data, "--model", "tiny", *rest, "--name", "r", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["steps"] == 1


@pytest.mark.parametrize("args, message", [
    (["train", "--modle", "tiny", "train.max_steps=1"], "unrecognized arguments: --modle (did you mean '--model'?)"),
    (["train", "train.max_steps=1", "--nmae", "x"], "unrecognized arguments: --nmae (did you mean '--name'?)"),
    (["generate", "--run", "runs/x", "train.max_steps=1"], "unrecognized arguments: train.max_steps=1"),
])
def test_a_misspelt_option_or_a_stray_word_is_an_error(tmp_path, args, message):
    result = lmforge(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(f"error: {message}")
    assert not (tmp_path / "runs").exists()


def test_help_and_runs_do_not_import_torch(tmp_path):
    """Building the parser, printing every help and listing runs leave torch unloaded."""
    code = """
import contextlib, io, sys
from lmforge.cli import main
for argv in (["--help"], ["train", "--help"], ["plan", "--help"], ["runs", "--help"], ["generate", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: lmforge" in out.getvalue(), argv
main(["runs", "."])
print("torch loaded:", "torch" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("torch loaded: False")


def test_every_help_prints_as_written(capsys):
    """Each subcommand's --help: argparse formats only an option's help with %, so a description
    written with %% prints it doubled."""
    from lmforge.cli import main
    from lmforge.cli.commands import SUBCOMMANDS

    for argv in [[], *([name] for name in SUBCOMMANDS), ["scaling", "sweep"], ["scaling", "fit"]]:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        shown = capsys.readouterr().out
        assert "usage: lmforge" in shown and "%%" not in shown, argv


def test_plan_tp_must_divide_the_heads(tmp_path):
    result = lmforge("plan", "--model", "llama3-8b", "--tp", "12", "--hardware", "h100-sxm", cwd=tmp_path)
    assert result.returncode == 2
    # config/rules.py's tp_divisibility: the launch's and the composition page's line
    assert result.stderr.strip() == ("lmforge: error: parallel.tp=12 must divide the KV heads (model.n_kv_heads) = 8 "
                                     "or be a multiple of them (each KV head then on tp / n_kv_heads ranks)")
    assert lmforge("plan", "--model", "llama3-8b", "--tp", "8", "--hardware", "h100-sxm").returncode == 0


def test_plan_shows_hardware_flops_only_with_recomputation(capsys):
    assert main(["plan", "--model", "tiny", "--hardware", "a100"]) == 0
    assert "hardware FLOPs" not in capsys.readouterr().out
    assert main(["plan", "--model", "tiny", "--hardware", "a100", "--recompute", "full"]) == 0
    assert "(with full recomputation)" in capsys.readouterr().out


def test_plan_plot_names_the_model_and_setup(tmp_path, capsys):
    from lmforge.accounting.plan.chart import setup_label

    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--precision", "bf16-mixed",
                 "--batch-size", "1", "--plot", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    label = setup_label(json.loads(capsys.readouterr().out))
    assert label == ("llama, 32 layers, d_model 4096, 8.03 G parameters\n"
                     "batch 1 x seq 8192, bf16-mixed, adamw, ZeRO 0, recompute none, sdpa attention")


def test_sample_prompt_defaults_to_the_start_of_a_validation_document(tmp_path, monkeypatch):
    """On a corpus that is not Python the end-of-run sample starts as its documents do, not with "def "."""
    corpus = tmp_path / "stories"
    corpus.mkdir()
    words = "the cat sat on a warm mat while rain fell over quiet hills and old roads".split()
    for n in range(80):
        body = " ".join(words[(n * 7 + i * 3) % len(words)] for i in range(300))
        (corpus / f"story{n:02d}.txt").write_text(f"Story number {n}. {body.capitalize()}.\n")
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus, tmp_path / "data", max_steps=2, eval_interval=2, checkpoint_interval=2,
                               sample_tokens=10)
    assert main(["train", "--model", "tiny", "--name", "s", "--no-progress", "data.val_fraction=0.2",
                 *overrides]) == 0
    assert (tmp_path / "runs" / "s" / "sample.txt").read_text().startswith("Story number ")



@pytest.mark.parametrize("args, message", [
    (["train", "--name", "a", "--out", "b"], "--name a (runs/a) and --out b name different run folders"),
    (["finetune", "runs/x", "--name", "a", "--out", "runs/b"], "--name a (runs/a) and --out runs/b name different"),
    (["import-hf", "hf", "--name", "a", "--out", "c"], "--name a (runs/a) and --out c name different run folders"),
    (["scaling", "sweep", "--out", "s", "--depths", "2.5", "--dry-run"], "--depths 2.5: give comma-separated whole"),
    (["scaling", "sweep", "--out", "s", "--depths", "2,3.0", "--dry-run"],
     "--depths 2,3.0: give comma-separated whole"),
])
def test_two_options_for_one_thing_or_a_cut_integer_are_refused(tmp_path, monkeypatch, args, message, capsys):
    """Two spellings of one setting that disagree, and a fraction where a whole number belongs, stop
    in one line (never the last one silently wins, never 2.5 read as 2), before anything is written."""
    from lmforge.cli import build_parser, parse_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:  # the command line alone decides: the parse, or a sweep's dry run
        raise SystemExit(main(args)) if args[0] == "scaling" else parse_args(build_parser(), args)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "s").exists()


def test_the_same_folder_by_name_and_by_out_is_one():
    from lmforge.cli import build_parser, parse_args

    args = parse_args(build_parser(), ["train", "--name", "a", "--out", "runs/a"])
    assert (args.name, args.out) == ("a", "runs/a")
