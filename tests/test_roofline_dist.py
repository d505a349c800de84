"""The roofline's step time under torchrun: 2 CPU ranks on gloo, train.parallel=ddp and zero2, the
tiny model. The collectives measured on a launched group (measure_collective: bench/ and
tests/roofline_dist_worker.py, never a training process) add the communication the roofline
predicts (not hidden behind compute: accounting/roofline/__init__.py); a run with
train.roofline=true sets the predicted step beside the measured one in the end-of-run table, on
the roof cached for its ranks' machine. No time is asserted."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.accounting import hardware
from lmforge.accounting.roofline.measure import _key
from lmforge.config import make_config
from tests.conftest import tiny_overrides
from tests.test_distributed_train import env, free_port
from tests.test_roofline_comm import _roof

pytestmark = pytest.mark.dist

TIMEOUT = 300  # seconds a launch may take before the test fails


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", *args]


def cache_a_roof_for_one_thread_ranks() -> None:
    """A synthetic roof in this session's cache, keyed as a rank with one thread (OMP_NUM_THREADS=1) reads it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        key = _key(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    fields = {k: v for k, v in dataclasses.asdict(_roof()).items() if k not in ("name", "source", "collective")}
    hardware._write_cache({**hardware._read_cache(), key: {"roof": fields}})


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_two_ranks_print_the_predicted_step_with_its_communication(tmp_path, corpus_dir, data_dir, strategy):
    worker = Path(__file__).with_name("roofline_dist_worker.py")
    result = subprocess.run(torchrun(str(worker), strategy), capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    predicted = json.loads(result.stdout.strip().splitlines()[-1])
    # the step's collectives' class, a share of the step (measured network, not 0)
    assert predicted["communication"] / predicted["step"] >= 0.0005, predicted

    overrides = [*tiny_overrides(corpus_dir, data_dir, max_steps=4, batch_size=2), f"train.parallel={strategy}",
                 "train.roofline=true"]
    from lmforge.data.prepare import prepare_data

    prepare_data(make_config("tiny", overrides=overrides), log=lambda _: None, progress=False)
    cache_a_roof_for_one_thread_ranks()
    command = torchrun("-m", "lmforge", "train", "--no-progress", "--model", "tiny", *overrides, "--out", "run")
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("step time (roofline)") == 1  # rank 0 alone prints the table
    assert "warning" not in result.stderr, result.stderr
    row = json.loads((tmp_path / "run" / "summary.json").read_text())["predicted_vs_measured"]["step_seconds"]
    assert row["predicted"] > 0 and row["measured"] > 0
