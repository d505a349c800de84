"""`lmforge train` carries no estimator it does not need: it trains with every optimizer lmforge
trains (the roofline's fake-tensor trace, which could not run Adafactor's `.item()`, is no longer
in the training path), and an estimator or report that raises (the plan, the summary's comparison
with it, the end-of-run roofline) is one warning line while the run trains to its end."""

import json

import pytest

from lmforge.cli import main
from lmforge.data.prepare import prepare_data
from lmforge.config import make_config
from lmforge.modes import TRAINED_OPTIMIZERS
from tests.conftest import tiny_overrides


@pytest.fixture
def train(corpus_dir, data_dir, tmp_path, capsys):
    """`lmforge train --model tiny ...` for 3 steps on the session's prepared data (prepared once):
    (exit status, stderr, the run's summary.json or None)."""
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=3, batch_size=2, eval_batches=1)
    prepare_data(make_config("tiny", overrides=overrides), log=lambda _: None, progress=False)

    def run(*extra: str, name: str = "run"):
        status = main(["train", "--model", "tiny", "--no-progress", "--out", str(tmp_path / name), *overrides, *extra])
        summary = tmp_path / name / "summary.json"
        return status, capsys.readouterr().err, json.loads(summary.read_text()) if summary.exists() else None

    return run


@pytest.mark.parametrize("optimizer", TRAINED_OPTIMIZERS)
def test_every_optimizer_trains(train, optimizer):
    status, err, summary = train(f"optim.name={optimizer}", name=optimizer)
    assert status == 0, err
    assert summary["steps"] == 3 and "warning" not in err


def _raises(*args, **kwargs):
    raise RuntimeError("an accounting bug\nwith a second line")


@pytest.mark.parametrize("estimator", ["lmforge.train.measurements.make_plan",
                                       "lmforge.train.summary.predicted_vs_measured"])
def test_an_estimator_that_raises_is_one_warning_line_and_the_run_trains(train, monkeypatch, estimator):
    monkeypatch.setattr(estimator, _raises)
    status, err, summary = train()
    assert status == 0, err
    assert summary["steps"] == 3 and summary["val_loss"] > 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "RuntimeError: an accounting bug" in warnings[0], err
    assert "second line" not in err


def test_the_roofline_row_reads_only_a_cached_roof(train, monkeypatch):
    """train.roofline=true without a roof in the cache: one line saying how to cache one, nothing measured."""
    import lmforge.accounting.roofline.measure as measure
    import lmforge.accounting.roofline.shapes as shapes

    monkeypatch.setattr(measure, "measure_roof", _raises)  # measuring inside training fails the test
    monkeypatch.setattr(shapes, "cached_roof", lambda device: None)  # whatever this machine's cache holds
    status, err, summary = train("train.roofline=true")
    assert status == 0 and summary["steps"] == 3, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "lmforge plan --roofline" in warnings[0], err
    assert "step_seconds" not in summary["predicted_vs_measured"]


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_the_roofline_row_on_a_cached_roof_after_training(train, monkeypatch, optimizer):
    """On a cached roof the summary sets the roofline's step beside the measured one; Adafactor's
    step, which the fake trace cannot run (its `.item()`), is one warning line instead."""
    import lmforge.accounting.roofline.shapes as shapes
    from tests.test_roofline_comm import _roof

    monkeypatch.setattr(shapes, "cached_roof", lambda device: _roof())
    status, err, summary = train("train.roofline=true", f"optim.name={optimizer}", name=optimizer)
    assert status == 0 and summary["steps"] == 3, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    if optimizer == "adamw":
        assert not warnings and summary["predicted_vs_measured"]["step_seconds"]["predicted"] > 0, err
    else:
        assert len(warnings) == 1 and "the roofline's step time failed" in warnings[0], err
