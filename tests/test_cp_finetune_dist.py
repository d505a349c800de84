"""`lmforge finetune --lora-rank 4` with parallel.cp=2 under torchrun (2 ranks, gloo) against one
process: the same base (tests/test_finetune_dist.py's), the same prompt/response examples, the
same batch (both cp ranks of the one replica draw its rows, each keeps half of every sequence).

Unlike data parallelism over examples (test_finetune_dist.py compares plain text only, since each
DDP rank averages over its own response tokens), context parallelism divides every shard's summed
loss by the whole group's target count (parallel/cp_model.py), so examples whose responses fall
unevenly between the two shards train as one process does.

Tolerance: test_finetune_dist.py's 1e-5 on every logged loss and adapter weight (fp32: the ring
and the all-reduce sum in another order than one process; AdamW moves a weight by at most ~lr =
1e-3 per step, and an unaveraged or miscounted loss moves the losses in the second decimal).
"""

import pytest

from lmforge.runs.checkpoint.find import find_checkpoint
from lmforge.runs.checkpoint.read import read_tensors
from test_finetune_dist import assert_same_runs, base, finetune, settings  # noqa: F401 (base: a fixture)

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_a_lora_finetune_on_examples_with_cp2_equals_one_process(base, tmp_path):  # noqa: F811
    run = ["--base", str(base[0]), f"data.source={base[1]}", "--lora-rank", "4", *settings(4)]
    finetune(tmp_path, *run, "--out", "one")
    result = finetune(tmp_path, *run, "parallel.cp=2", "train.parallel=ddp", "--out", "cp", nproc=2)
    assert result.stdout.count("lmforge train: summary") == 1  # rank 0 alone reports
    assert_same_runs(tmp_path / "cp", tmp_path / "one")
    adapters = read_tensors(find_checkpoint(tmp_path / "cp"))
    assert adapters and all(name.endswith((".lora_A", ".lora_B")) for name in adapters)
