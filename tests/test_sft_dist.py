"""The loss of a step on fine-tuning examples is the mean over all its target tokens (issue 26).

Examples hold a target per response token (data/sft.py), so rows, micro-batches and ranks hold
different numbers of them; a mean of per-micro-batch or per-rank means would weigh the tokens of
short responses more. Checked: two accumulated micro-batches equal one batch of their rows, and
two ranks under torchrun (gloo; ddp and zero1) equal one process on the same global batch.
Run as a script under torchrun, this file is the ranks' worker.

Tolerance, fp32: the same sums in another order, ~1e-7 relative (tests/test_parallel_engines.py);
a mean of means misses here by several percent.
"""

import datetime
import random
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lmforge.config import make_config
from lmforge.data.sft import ExampleSet, example_batch, pad_examples
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.modes import get_policy
from lmforge.precision.policy import LossScaler
from lmforge.train.setup import build_engine

SEQ, ROWS, ACCUM = 24, 3, 2  # positions per row; rows per rank per micro-batch; micro-batches per step


def uneven_examples(vocab: int, count: int = 16, seed: int = 0) -> ExampleSet:
    """Examples of a short prompt and a response of 1 to SEQ - 4 tokens."""
    rng = random.Random(seed)
    encoded = []
    for index in range(count):
        prompt, response = rng.randint(2, 4), rng.randint(1, SEQ - 4)
        ids = [rng.randrange(1, vocab) for _ in range(prompt + response)]
        encoded.append((f"e{index}", ids, [False] * prompt + [True] * response))
    return pad_examples(encoded, SEQ, end=0)


def engine_of(parallel: str):
    cfg = make_config("tiny", overrides=[f"train.parallel={parallel}", "train.precision=fp32"])
    torch.manual_seed(cfg.train.seed)
    return build_engine(cfg, get_policy("fp32"))


def micro_batches(examples: ExampleSet, rows: int, rank: int = 0, ranks: int = 1):
    """This rank's rows of each micro-batch of a step of ACCUM micro-batches of ranks * rows rows."""
    return [example_batch(examples, rows, SEQ, seed=0, index=i, rank=rank, world_size=ranks) for i in range(ACCUM)]


def step(engine, batches) -> tuple[float, float, dict]:
    """One step's forward and backward: (loss over the ranks, gradient norm, this rank's gradients)."""
    scaler, left = LossScaler(enabled=False), iter(batches)
    loss = engine.forward_backward(lambda: next(left), len(batches), scaler, get_policy("fp32"), torch.device("cpu"))
    engine.finish_gradients()
    _, norm = engine.unscale_and_clip(scaler, 0.0)  # 0: no clipping
    grads = {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    return engine.mean_across_ranks(loss).item(), norm.item(), grads


def test_accumulated_micro_batches_of_uneven_examples_equal_one_batch():
    engine = engine_of("none")
    examples = uneven_examples(engine.model.cfg.vocab_size)
    batches = micro_batches(examples, ROWS)
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in batches]
    assert counts[0] != counts[1]  # what a mean of the two means gets wrong
    accumulated, norm, grads = step(engine, batches)
    engine.zero_grad()
    whole = [tuple(torch.cat(parts) for parts in zip(*batches))]
    one, one_norm, one_grads = step(engine, whole)
    assert accumulated == pytest.approx(one, rel=1e-6)
    assert norm == pytest.approx(one_norm, rel=1e-5)
    for name, grad in one_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_two_ranks_on_uneven_examples_equal_one_process(tmp_path):
    out = tmp_path / "ranks.pt"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", __file__, str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = torch.load(out)
    engine = engine_of("none")
    loss, norm, grads = step(engine, micro_batches(uneven_examples(engine.model.cfg.vocab_size), 2 * ROWS))
    for parallel, (rank_loss, rank_norm, rank_grads) in ranks.items():
        assert rank_loss == pytest.approx(loss, rel=1e-6), parallel
        assert rank_norm == pytest.approx(norm, rel=1e-5), parallel
        for name, grad in rank_grads.items():  # ddp: every gradient, averaged over the ranks
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-7, msg=f"{parallel} {name}")


def worker(out: str) -> None:
    """Each rank's step on its rows of the global batch; rank 0 saves (loss, norm, ddp's gradients)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for parallel in ("ddp", "zero1"):
        engine = engine_of(parallel)
        batches = micro_batches(uneven_examples(engine.model.cfg.vocab_size), ROWS, rank, ranks)
        loss, norm, grads = step(engine, batches)
        results[parallel] = (loss, norm, grads if parallel == "ddp" else {})
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])
