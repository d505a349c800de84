"""Context parallelism in the trainer (parallel.cp=2, train.parallel=ddp) over real gloo process
groups: train/setup.py's engine on cp=2 (2 ranks) and cp=2 x dp=2 (4 ranks) trains as one process
does on the same global batch (tests/cp_train_worker.py computes both on every rank), and
`lmforge train` under torchrun trains, checkpoints and resumes as one process does.

Tolerance, fp32. The ring and the dp x cp all-reduce sum in another order than one process, so
each step's numbers differ in the last bits: measured, losses within 2.1e-7 relative and gradient
norms within 4.9e-7 over 3 steps (checked: 1e-6 and 2e-6). AdamW moves a weight by about lr per
step whatever its gradient's size, so most weights agree to 1e-6; an element whose gradient is a
cancellation near zero can flip sign under the other order and move by ~lr instead (measured: at
most 0.0055% of 164,160 elements beyond 1e-5, the largest 1.2e-4 at lr 3e-3; checked: 0.05% and
2 x steps x lr). AdamW is blind to the gradient's scale, so the norms are what catch a wrong
weighting: broken by hand once at cp=2, counting each replica's targets cp times (no `self.cp *` in
parallel/engine.py's loss_divisors) halved every loss and norm; cp ranks drawing different rows (each
its own replica) gave losses of 13.7 against 6.8; both fail here.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import run_worker  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "cp_train_worker.py"
CASES = {"plain": [], "sft29": ["+sft", "seq=29"]}  # 32 tokens; prompts without targets, 29 (padded to 32)
STEPS, LR = 3, 3e-3


def assert_as_one_process(case: dict) -> None:
    ref = case["ref"]
    assert case["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert case["norms"] == pytest.approx(ref["norms"], rel=2e-6)
    assert case["model"].keys() == ref["model"].keys()
    diff = torch.cat([(case["model"][k] - ref["model"][k]).abs().flatten() for k in ref["model"]])
    assert diff.max().item() <= 2 * STEPS * LR and (diff > 1e-5).float().mean().item() <= 5e-4
    for name, tensor in case["model"].items():  # the state by name, full tensors, loads back exactly
        assert torch.equal(case["reloaded"][name], tensor), name


@pytest.mark.parametrize("ranks", [2, 4])
def test_cp2_engine_trains_as_one_process(tmp_path, ranks):
    results = run_worker(tmp_path, ranks, CASES, WORKER)
    assert len(results) == ranks
    for rank, result in enumerate(results):
        for name, case in result.items():
            # rank = (dp_index * cp + cp_index): both cp ranks of a replica draw its rows
            assert (case["replicas"], case["replica"], case["cp_rank"]) == (ranks // 2, rank // 2, rank % 2)
            assert_as_one_process(case)


# -- `lmforge train` under torchrun ----------------------------------------------------------------

@pytest.fixture(scope="module")
def settings(corpus_dir, data_dir):
    from tests.test_tp_train_dist import STEPS as TRAIN_STEPS
    from tests.conftest import tiny_overrides

    def build(batch_size: int, max_steps: int = TRAIN_STEPS):
        return [*tiny_overrides(corpus_dir, data_dir, max_steps=max_steps, batch_size=batch_size, eval_interval=2,
                                checkpoint_interval=2, log_interval=1), f"optim.decay_steps={TRAIN_STEPS + 2}",
                "optim.lr=1e-3", "train.device=cpu"]
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data
    prepare_data(make_config("tiny", overrides=build(4)), log=lambda _: None, progress=False)
    return build


@pytest.mark.slow
def test_lmforge_train_cp2_trains_checkpoints_and_resumes_as_one_process(tmp_path, settings):
    from tests.test_distributed_train import losses, torchrun
    from tests.test_tp_train_dist import assert_close_runs, run
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *settings(4), "--out", "one"],
        tmp_path)
    result = run(torchrun(2, "--model", "tiny", *settings(4), "parallel.cp=2", "train.parallel=ddp", "--out", "cp"),
                 tmp_path)
    assert result.stdout.count("lmforge train: summary") == 1  # rank 0 alone reports
    assert_close_runs(tmp_path / "cp", tmp_path / "one")  # losses (train and validation) and weights
    # both resumed to step 6: the cp run under torchrun again (its checkpoint: full weights by name)
    reference = tmp_path / "one_resumed"
    shutil.copytree(tmp_path / "one", reference)
    run(torchrun(2, "--resume", str(tmp_path / "cp"), "train.max_steps=6"), tmp_path)
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--resume", str(reference), "train.max_steps=6"],
        tmp_path)
    assert [s for s, _ in losses(tmp_path / "cp")][-3:] == [5, 6, 6]
    assert_close_runs(tmp_path / "cp", reference, steps=6)
