"""The composition matrix (tests/composition_matrix.py) and its page: docs/composition.md is what
the checks say now, every test it names exists, and every refused cell is refused by the launch
checks alone, in one line, before any process group or file exists."""

import re
from pathlib import Path

import sys

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from composition_matrix import COVERAGE, EXTRAS, KINDS, LAYOUTS, PRECISIONS, page, verdict  # noqa: E402

ROOT = Path(__file__).parent.parent


def test_the_committed_page_is_what_the_checks_say_now():
    committed = (ROOT / "docs" / "composition.md").read_text()
    assert committed == page(), "regenerate: python tests/composition_matrix.py > docs/composition.md"


def test_every_test_the_page_names_exists():
    for covered in COVERAGE:
        path, name = covered.test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), covered.test


def test_every_covered_cell_passes_the_checks():
    # a test cannot train a cell the launch refuses: the coverage list and the checks agree
    for c in COVERAGE:
        for layout in c.layouts:
            for precision in c.precisions:
                for kind in c.kinds:
                    assert verdict(LAYOUTS[layout], precision, kind, c.extra) is None, (c.test, layout, precision)


def every_cell():
    for layout in LAYOUTS.values():
        for precision in PRECISIONS:
            for kind in KINDS:
                yield layout, precision, kind, None
        for extra in EXTRAS:
            yield layout, "fp32", "pretraining", extra


def test_refused_cells_stop_before_any_process_group_or_file_with_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused = {}
    for layout, precision, kind, extra in every_cell():
        line = verdict(layout, precision, kind, extra)
        if line is not None:
            refused[(layout.name, precision, kind, extra)] = line
    assert refused  # today: pipelines with ZeRO or FSDP replicas (and with LoRA until that lands)
    for cell, line in refused.items():
        assert "\n" not in line and len(line) < 300, cell
        assert re.search(r"\b(use|set|launch)\b", line), (cell, line)  # says what to do instead
    assert not dist.is_initialized()
    assert list(tmp_path.iterdir()) == []  # nothing written: the checks read the config alone


def test_the_one_process_row_and_every_strategy_pass_in_fp32():
    for name in ("one process", "ddp", "zero1", "zero2", "zero3", "fsdp", "pipeline", "pipeline x ddp"):
        assert verdict(LAYOUTS[name], "fp32") is None, name


def test_a_pipeline_takes_ddp_or_zero1_replicas_and_refuses_the_sharded_rest():
    for strategy in ("ddp", "zero1"):
        assert verdict(LAYOUTS[f"pipeline x {strategy}"], "fp32") is None, strategy
    for strategy in ("zero2", "zero3", "fsdp"):
        line = verdict(LAYOUTS[f"pipeline x {strategy}"], "fp32")
        assert line.startswith(f"train.parallel={strategy} does not combine with parallel.pp=2")
        assert line.endswith("use train.parallel=zero1 (shards each stage's optimizer states) or ddp")
