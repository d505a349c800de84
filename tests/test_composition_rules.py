"""Each composition refusal is written once (lmforge/config/rules.py): the launch check, config
validation and the generated page (docs/composition.md) give the same line for the same cells."""

import re
import sys
from pathlib import Path

import pytest

from lmforge.common.errors import LmforgeError
from lmforge.config import make_config, validate
from lmforge.config.rules import PIPELINE_REFUSED, check_composition
from lmforge.modes import PARALLEL_STRATEGIES, STAGE_REPLICAS
from lmforge.parallel.world import check_launch

sys.path.insert(0, str(Path(__file__).parent))
from composition_matrix import LAYOUTS, SHORT_KINDS, cell_overrides  # noqa: E402

PAGE = Path(__file__).parent.parent / "docs" / "composition.md"


def page_line(layout: str, precision: str, kind: str) -> str | None:
    """The refusal line the committed page gives the main table's cell, or None (it trains)."""
    text = PAGE.read_text()
    lines = dict(re.findall(r"^- \*\*(r\d+)\*\* (.*)$", text, re.M))
    table = text[text.index("| layout (ranks) |"):].split("\n\n")[0].splitlines()
    header, rows = table[0], table[2:]
    columns = [c.strip() for c in header.strip("|").split("|")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0].rsplit(" (", 1)[0] == layout:
            mark = cells[columns.index(f"{precision} {SHORT_KINDS[kind]}")]
            return lines[mark.split()[1]] if mark.startswith("✗") else None
    raise AssertionError(f"no row {layout}")


def refusal(cfg, world: int | None) -> str | None:
    """The line check_composition stops with, or None when everything combines."""
    try:
        check_composition(cfg, world)
    except LmforgeError as err:
        return str(err)
    return None


def launch_line(cfg, ranks: int) -> str | None:
    try:
        check_launch(cfg, None if ranks == 1 else (0, ranks, 0), cuda_devices=0)
    except LmforgeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("layout, precision, kind", [
    ("pipeline x zero2", "fp32", "pretraining"), ("pipeline x fsdp", "bf16-mixed", "LoRA"),
    ("tp x cp, sequence parallel", "fp8", "full fine-tuning"), ("pipeline x zero1", "fp16-mixed", "pretraining")])
def test_the_launch_check_the_rules_and_the_page_give_one_line_per_cell(layout, precision, kind):
    row = LAYOUTS[layout]
    cfg = make_config("tiny", overrides=cell_overrides(row, precision, kind))  # validated: the launch refuses
    line = launch_line(cfg, row.ranks)
    assert line == refusal(cfg, row.world) == page_line(layout, precision, kind)
    assert (line is None) == (layout == "pipeline x zero1")  # a cell that trains: no line anywhere


@pytest.mark.parametrize("overrides, change", [
    (["parallel.pp=2", "train.micro_batches=2"], ("train", "grad_accum", 2)),
    (["model.attention=flash_triton"], ("train", "compile", True)),
    (["train.parallel=zero2", "parallel.dp_replicate=2"], ("parallel", "dp_shard", 2)),
])
def test_config_validation_and_the_launch_check_give_the_same_line(overrides, change):
    """A refusal that needs no world stops the config from being made, with the line the launch check
    (given the same settings, unvalidated) and the rules give."""
    section, key, value = change
    with pytest.raises(LmforgeError) as made:
        make_config("tiny", overrides=["train.device=cpu", *overrides, f"{section}.{key}={value}".lower()])
    cfg = make_config("tiny", overrides=["train.device=cpu", *overrides])
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(LmforgeError) as validated:
        validate(cfg)
    assert str(made.value) == str(validated.value) == launch_line(cfg, 4) == refusal(cfg, 4) == refusal(cfg, None)
    with pytest.raises(LmforgeError, match=re.escape(str(made.value))):
        check_composition(cfg, 4)


def test_every_strategy_a_pipeline_refuses_says_why():
    assert set(PIPELINE_REFUSED) == set(PARALLEL_STRATEGIES) - set(STAGE_REPLICAS)
