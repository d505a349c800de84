"""The roofline's step time under torchrun: 2 CPU ranks on gloo, train.parallel=ddp and zero2, the
tiny model. The trainer measures all-reduce on the launched group (measure_collective), adds the
communication the roofline predicts (not hidden behind compute: accounting/roofline/__init__.py) and sets
the predicted step beside the measured one in the end-of-run table. No time is asserted."""

import json
import subprocess
import sys

import pytest

from lmforge.config import make_config
from tests.conftest import tiny_overrides
from tests.test_distributed_train import env, free_port

pytestmark = pytest.mark.dist

TIMEOUT = 300  # seconds a launch may take before the test fails (the roof is measured once, 10-35 s)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_two_ranks_print_the_predicted_step_with_its_communication(tmp_path, corpus_dir, data_dir, strategy):
    overrides = [*tiny_overrides(corpus_dir, data_dir, max_steps=4, batch_size=2), f"train.parallel={strategy}"]
    from lmforge.data.prepare import prepare_data

    prepare_data(make_config("tiny", overrides=overrides), log=lambda _: None, progress=False)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *overrides, "--out", "run"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("step time (roofline)") == 1  # rank 0 alone prints the table
    # the plan's roofline table has the collectives' class, a share of the step (measured network, not 0)
    # (printed with the plan at the start and again beside the measurements at the end)
    rows = [line for line in result.stdout.splitlines() if "communication" in line and "%" in line]
    assert rows and not any("0.0%" in row for row in rows), rows
    row = json.loads((tmp_path / "run" / "summary.json").read_text())["predicted_vs_measured"]["step_seconds"]
    assert row["predicted"] > 0 and row["measured"] > 0
