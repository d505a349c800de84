"""bench/pipeline_bubble.py's parts, without its runs: the command it launches is one the CLI and
the config accept, the summary record it reads, its table and its plot from made-up results."""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from lmforge.accounting.pipeline import bubble_fraction
from lmforge.cli import build_parser
from lmforge.config import make_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipeline_bubble", ROOT / "bench" / "pipeline_bubble.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_results() -> list[dict]:
    """A bubble 10% above the formula's, stage 0 idling a little less than the last."""
    results = []
    for schedule in ("1f1b", "gpipe"):
        for p in (2, 4):
            for m in (1, 2, 4, 8, 16):
                formula = bubble_fraction(p, m)
                results.append({"bubble_measured": 1.1 * formula, "bubble_formula": formula,
                                "idle_fraction_per_stage": [1.1 * formula - 0.01 * (p - 1 - s) for s in range(p)],
                                "schedule": schedule, "stages": p, "micro_batches": m})
    return results


@pytest.mark.parametrize("stages,micro_batches,schedule", [(2, 1, "gpipe"), (4, 16, "1f1b"),
                                                          (4, 8, "interleaved-1f1b")])
def test_train_command_is_a_valid_pipeline_run(bench, tmp_path, stages, micro_batches, schedule):
    common = bench.common_args(tmp_path / "corpus", tmp_path / "data", shlex.split(bench.DEFAULT_MODEL_ARGS), 3)
    command = bench.train_command(stages, micro_batches, schedule, tmp_path / "run", common, virtual_stages=2)
    assert command[1:4] == ["-m", "lmforge", "train"]
    args = build_parser().parse_args(command[3:])
    assert args.nproc == stages and args.out == str(tmp_path / "run") and args.no_progress
    cfg = make_config(args.model, args.config, args.overrides)  # validates: the split fits, m applies
    assert (cfg.parallel.pp, cfg.train.micro_batches, cfg.train.schedule) == (stages, micro_batches, schedule)
    assert cfg.train.pipeline_virtual_stages == (2 if schedule == "interleaved-1f1b" else 1)
    assert cfg.train.max_steps == 3 and cfg.train.sample_tokens == 0 and cfg.train.eval_batches == 1
    assert cfg.model.n_layers == 8 and not cfg.model.tie_embeddings
    assert cfg.data.source == str(tmp_path / "corpus") and cfg.data.dir == str(tmp_path / "data")


def test_read_result_takes_the_pipeline_record(bench, tmp_path):
    record = fake_results()[3]
    (tmp_path / "summary.json").write_text(json.dumps({"val_loss": 4.2, "pipeline": record}))
    assert bench.read_result(tmp_path) == record
    (tmp_path / "summary.json").write_text(json.dumps({"val_loss": 4.2}))
    with pytest.raises(SystemExit, match="no \"pipeline\" record"):
        bench.read_result(tmp_path)
    with pytest.raises(SystemExit, match="missing: the run did not finish"):
        bench.read_result(tmp_path / "elsewhere")


def test_table_has_one_row_per_run(bench):
    results = fake_results()
    lines = bench.format_table(results).splitlines()
    assert len(lines) == 2 + len(results)
    cells = [cell.strip() for cell in lines[2 + 6].strip("|").split("|")]  # 1f1b, p=4, m=2
    assert cells == ["1f1b", "4", "1", "2", "0.600", "0.660", "1.10", "0.630 0.640 0.650 0.660"]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_plot_is_written(bench, tmp_path):
    path = tmp_path / "bubble.png"
    interleaved = [{**r, "schedule": "interleaved-1f1b", "virtual_stages": 2,
                    "bubble_formula": bubble_fraction(r["stages"], r["micro_batches"], 2)}
                   for r in fake_results() if r["schedule"] == "1f1b" and r["micro_batches"] % r["stages"] == 0]
    bench.plot_bubbles(fake_results() + interleaved, path, "made-up results")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_corpus_is_a_few_hundred_kilobytes_of_python(bench, tmp_path):
    folder = bench.make_corpus(tmp_path / "corpus", limit=50_000)
    files = list(folder.glob("*.py"))
    total = sum(len(f.read_text()) for f in files)
    assert files and 50_000 < total < 50_000 + max(len(f.read_text()) for f in files) + 1
