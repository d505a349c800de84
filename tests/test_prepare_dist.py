"""Preparing data inside a torchrun launch (lmforge/parallel/world.py, World.main_first): rank 0
prepares a fresh folder while the others wait through the rendezvous store, however long it takes,
and the first waiting process says so; an error on rank 0 stops every rank with one line.

The collective timeout is set to 3 s and the corpus (20 MB of Python) takes longer than that to
prepare on a 2-core machine (the test checks it): a wait by collective (as before) dies at the
timeout, with a traceback."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from test_distributed_train import env, torchrun
from tests.conftest import stdlib_corpus, tiny_overrides

pytestmark = pytest.mark.dist

TIMEOUT = 120  # seconds a launch may take before the test fails (it never hangs the suite)
DIST_TIMEOUT = 3


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """About 20 MB of the standard library's Python, flattened into one folder: it takes longer to
    prepare than DIST_TIMEOUT (the test asserts it), with room for a fast machine."""
    return stdlib_corpus(tmp_path_factory.mktemp("big_corpus"), 20_000_000, recursive=True)


def launch(cwd: Path, corpus: Path, data_dir: Path) -> subprocess.CompletedProcess:
    overrides = tiny_overrides(corpus, data_dir, max_steps=2, batch_size=2, eval_interval=2, checkpoint_interval=2,
                               log_interval=1)
    return subprocess.run(torchrun(2, "--model", "tiny", *overrides, "train.parallel=ddp",
                                   f"train.dist_timeout={DIST_TIMEOUT}", "--out", "run"),
                          cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env())


def test_ranks_wait_for_rank_0_to_prepare_longer_than_the_collective_timeout(tmp_path, big_corpus):
    data_dir = tmp_path / "data"
    result = launch(tmp_path, big_corpus, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    # the preparation took longer than a collective may wait: the test tests what it says
    seconds = float(re.search(r"unigram\s+entropy [\d.]+ nats \((\d+\.\d+)s\)", result.stdout).group(1))
    assert seconds > DIST_TIMEOUT, seconds
    assert result.stderr.count(f"rank 1: waiting for rank 0 to prepare {data_dir}") == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_trained"] == 2 * 4 * 64  # 2 steps of 2 ranks x 2 windows of 64 tokens


def test_an_error_preparing_on_rank_0_stops_every_rank_with_one_line(tmp_path, corpus_dir):
    data_dir = tmp_path / "data"
    data_dir.mkdir()  # a folder that is not prepared data: rank 0 refuses it
    result = launch(tmp_path, corpus_dir, data_dir)
    assert result.returncode != 0
    assert result.stderr.count("holds no meta.json") == 1, result.stderr[-3000:]
    # rank 1 stops quietly (on rank 0's error, or torchrun's SIGTERM): no traceback of lmforge's code
    # (torchrun prints its own summary of the failed launch)
    assert "/lmforge/" not in result.stderr and "rank 1:" not in result.stderr, result.stderr[-3000:]
