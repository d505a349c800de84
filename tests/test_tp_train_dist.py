"""`lmforge train` with parallel.tp under torchrun: real processes on gloo, the tiny model, real
prepared data. tp=2 on 2 ranks and tp=2 x ddp=2 on 4 train as one process does on the same
global batch; a checkpoint of the tp=2 run (full tensors by name) resumes in one process.

Tolerance (fp32): as tests/test_distributed_train.py. The split matmuls and the all-reduces sum in
another order than one process, so each step's numbers differ in the last bits (measured: losses
to 1e-7 relative); AdamW moves a parameter by at most ~lr per step whatever its gradient, so four
steps at lr 1e-3 keep nearly all weights within 1e-5 absolute of one process's; the exception is a
gradient element that is itself a cancellation near zero, whose sign the other summation order can
flip, and Adam moves it by ~lr instead (measured: 1 element of 131,392 at 1.4e-5, a rare token's
embedding). So per tensor: max |diff| <= 2 K lr and at most 0.1% of the elements beyond 1e-5. A wrong
shard, a missing f or g or a tensor-parallel pair drawing different batches moves most elements by
~lr and the losses in the second decimal (losses: within 1e-5).
"""

import shutil
import subprocess
import sys

import pytest

from tests.test_distributed_train import env, final_weights, losses, torchrun
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, TIMEOUT, LR = 4, 240, 1e-3


def assert_close_runs(a, b, steps: int = STEPS):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name] - wb[name]).abs()
        assert diff.max().item() <= 2 * steps * LR and (diff > 1e-5).float().mean().item() <= 1e-3, name
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb]
    for (step, x), (_, y) in zip(la, lb):
        assert abs(x - y) <= 1e-5, (step, x, y)


def run(command, cwd):
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def settings(corpus_dir, data_dir):
    def build(batch_size: int, max_steps: int = STEPS):
        return [*tiny_overrides(corpus_dir, data_dir, max_steps=max_steps, batch_size=batch_size, eval_interval=2,
                                checkpoint_interval=2, log_interval=1), f"optim.decay_steps={STEPS + 2}",
                f"optim.lr={LR}", "train.device=cpu"]
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data
    prepare_data(make_config("tiny", overrides=build(4)), log=lambda _: None, progress=False)
    return build


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, settings):
    cwd = tmp_path_factory.mktemp("one")
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(4), "--out", "run"], cwd)
    return cwd / "run"


def test_tp2_trains_as_one_process_and_resumes_in_one_process(tmp_path, settings, one_process):
    result = run(torchrun(2, "--model", "tiny", *settings(4), "parallel.tp=2", "--out", "run"), tmp_path)
    assert result.stdout.count("lmforge train: summary") == 1  # rank 0 alone reports
    assert_close_runs(tmp_path / "run", one_process)
    # both resumed to step 6 in one process: the tp=2 checkpoint holds the full model
    reference = tmp_path / "one"
    shutil.copytree(one_process, reference)
    for folder in (tmp_path / "run", reference):
        run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--resume", str(folder),
             "train.max_steps=6", "parallel.tp=1"], tmp_path)
    assert [s for s, _ in losses(tmp_path / "run")][-3:] == [5, 6, 6]
    assert_close_runs(tmp_path / "run", reference, steps=6)


def test_tp2_times_ddp2_on_4_ranks_trains_as_one_process(tmp_path, settings, one_process):
    run(torchrun(4, "--model", "tiny", *settings(2), "parallel.tp=2", "train.parallel=ddp", "--out", "run"), tmp_path)
    assert_close_runs(tmp_path / "run", one_process)
