"""Pipeline parallelism (lmforge/parallel/pipeline/) against one process, against
torch.distributed.pipelining, and against the schedules' memory bound: real processes under
torchrun, gloo, the `tiny` model (2 layers; 4 for four stages).

Tolerance, fp32. A pipeline of m micro-batches computes what one process accumulating m
micro-batches (train.grad_accum=m) computes, operation for operation: each stage runs the same
layers on the same rows, and the backwards run in micro-batch order, so every gradient is summed
in the same order. Two things are summed differently: a tied embedding matrix gets the embedding's
and the head's parts on two ranks, added once at the end instead of interleaved per micro-batch,
and the clipping norm is a sum over stages. Untied and unclipped, the pipeline is therefore
bit-identical to one process (checked); tied and clipped, parameters differ by float rounding
(measured: at most 1.2e-7 after 4 steps at lr 1e-3), checked with the data-parallel tests' bound
(every element within 2 K lr, at most 0.1% beyond 1e-6) and the losses to 1e-6 relative.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import make_engine  # noqa: E402
from pipeline_worker import ROWS, STEPS, config, train  # noqa: E402

from tests.test_distributed_train import env, free_port  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "pipeline_worker.py"
TIMEOUT = 300
M = 4  # micro-batches per step
FOUR_LAYERS = ["model.n_layers=4"]


def run_worker(tmp_path, ranks: int, runs: dict, worker: Path = WORKER, timeout: int = TIMEOUT) -> dict:
    """`worker` under torchrun on `ranks` ranks, given `runs` (name -> overrides); its saved results."""
    out = tmp_path / f"{ranks}.pt"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                             f"--master_port={free_port()}", str(worker), str(out), json.dumps(runs)],
                            capture_output=True, text=True, timeout=timeout, env=env())
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


def pipeline(stages: int, schedule: str, m: int = M, *extra: str) -> list[str]:
    return [f"parallel.pp={stages}", f"train.micro_batches={m}", f"train.schedule={schedule}", *extra]


def single_process(m: int, replicas: int = 1, *extra: str) -> dict:
    """One process accumulating the same m micro-batches of replicas * ROWS rows (a fine-tune from
    parallel_worker.py's base)."""
    cfg = config([f"train.grad_accum={m}", *extra])
    torch.manual_seed(cfg.train.seed)
    engine = make_engine(cfg, [])
    losses, norms = train(engine, cfg, m, 0, 1, rows=replicas * ROWS)
    return dict(model=engine.model_state_dict(), losses=losses, norms=norms)


def assert_same_training(result: dict, reference: dict, lr: float = 3e-3, atol: float = 1e-6):
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    ref = reference["model"]
    # the tied head is the embedding matrix: one name in a pipeline's checkpoint, as in one process's
    assert set(ref) - set(result["model"]) <= {"lm_head.weight"} and set(result["model"]) <= set(ref)
    diff = torch.cat([(result["model"][k] - ref[k]).abs().flatten() for k in result["model"]])
    assert diff.max().item() <= 2 * STEPS * lr
    assert (diff > atol).float().mean().item() <= 1e-3, ((diff > 1e-6).float().mean().item(),
                                                        (diff > 1e-5).float().mean().item(), diff.max().item())
    assert result["replicas_equal"]  # every replica, and both copies of a tied matrix, hold the same numbers


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("pp2"), 2, {
        "gpipe": pipeline(2, "gpipe"), "1f1b": pipeline(2, "1f1b"),
        "torch_gpipe": pipeline(2, "gpipe", M, "train.pipeline_engine=torch"),
        "torch_1f1b": pipeline(2, "1f1b", M, "train.pipeline_engine=torch"),
        "exact": pipeline(2, "1f1b", M, "model.tie_embeddings=false", "optim.grad_clip=0"),
        "bf16": pipeline(2, "1f1b", M, "train.precision=bf16-mixed"),
        "recompute": pipeline(2, "gpipe", M, "train.recompute=full"),
    })


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("pp4"), 4, {
        "p4_gpipe": pipeline(4, "gpipe", 6, *FOUR_LAYERS), "p4_1f1b": pipeline(4, "1f1b", 6, *FOUR_LAYERS),
        "p2_dp2": pipeline(2, "1f1b", 3, *FOUR_LAYERS, "train.parallel=ddp"),
    })


def test_gpipe_and_1f1b_train_as_one_process_accumulating_the_micro_batches(two_ranks):
    reference = single_process(M)
    for key in ("gpipe", "1f1b", "torch_gpipe", "torch_1f1b"):
        assert_same_training(two_ranks[key], reference)


def test_untied_and_unclipped_the_pipeline_is_bit_identical_to_one_process(two_ranks):
    reference = single_process(M, 1, "model.tie_embeddings=false", "optim.grad_clip=0")
    result = two_ranks["exact"]
    assert result["losses"] == reference["losses"]
    assert set(result["model"]) == set(reference["model"])
    assert all(torch.equal(result["model"][k], reference["model"][k]) for k in reference["model"])


def test_bf16_mixed_pipeline_trains_as_one_process(two_ranks):
    reference = single_process(M, 1, "train.precision=bf16-mixed")
    assert_same_training(two_ranks["bf16"], reference)


def test_a_pipeline_with_full_recomputation_trains_as_one_process(two_ranks):
    assert_same_training(two_ranks["recompute"], single_process(M, 1, "train.recompute=full"))


def test_our_schedules_equal_torch_distributed_pipelining(two_ranks):
    # the same stages, micro-batches and loss / m: the same sums in the same order, bit for bit
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = two_ranks[schedule], two_ranks[f"torch_{schedule}"]
        assert ours["losses"] == theirs["losses"]
        assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in ours["model"])


def test_four_stages_and_two_by_two_train_as_one_process(four_ranks):
    reference = single_process(6, 1, *FOUR_LAYERS)
    assert_same_training(four_ranks["p4_gpipe"], reference)
    assert_same_training(four_ranks["p4_1f1b"], reference)
    # 2 stages x 2 replicas: the global batch is both replicas' rows
    assert_same_training(four_ranks["p2_dp2"], single_process(3, 2, *FOUR_LAYERS))


def test_1f1b_holds_at_most_p_minus_s_micro_batches_of_activations_and_gpipe_all_m(four_ranks):
    p, m = 4, 6
    for schedule, bound in (("gpipe", lambda s: m), ("1f1b", lambda s: min(m, p - s))):
        for stage in range(p):
            held = four_ranks[f"p4_{schedule}"]["in_flight"][(0, stage)]
            assert held["micro_batches"] == bound(stage), (schedule, stage)
            # measured with saved-tensor hooks: the most bytes alive at once is that many micro-batches' worth
            assert held["one_micro_batch_bytes"] > 0
            assert held["activation_bytes"] == bound(stage) * held["one_micro_batch_bytes"], (schedule, stage)
