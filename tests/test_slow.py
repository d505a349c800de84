"""Longer checks, excluded from the default suite: `python -m pytest -m slow`."""

import json

import pytest

from lmforge.cli import main


@pytest.mark.slow
def test_default_model_learns_the_embedded_corpus(tmp_path, monkeypatch):
    """The `small` preset on the standard-library corpus, 150 steps (~1.5 min on 2 cores): the
    validation loss must fall far below the unigram entropy and the sample must look like Python."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--name", "s", "--no-progress", "train.max_steps=150", "train.eval_interval=75",
                 "train.checkpoint_interval=0", "train.sample_tokens=60"]) == 0
    summary = json.loads((tmp_path / "runs" / "s" / "summary.json").read_text())
    assert summary["val_loss"] < summary["unigram_entropy_nats"] - 1.0
    generated = summary["sample"].removeprefix("def ")  # the prompt, echoed, would pass by itself
    assert any(word in generated for word in ("self", "return", "import", "def", "    "))
