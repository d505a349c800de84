"""Sequence parallelism inside context parallelism and replicated KV heads under cp and FSDP2, in one
process: the padding that serves both shards, the launch that accepts them, the plan that counts
them. tests/test_sp_cp_dist.py trains them on 4 ranks against one process and measures the bytes."""

import json

import pytest
import torch

from lmforge.accounting.cp import context_parallel_bytes, padded_length
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.parallel.cp import shard_batch, zigzag_positions
from lmforge.parallel.cp_model import ContextParallel
from lmforge.parallel.world import check_launch

CP = ["parallel.cp=2", "train.parallel=ddp", "train.sample_tokens=0"]


@pytest.mark.parametrize("seq, cp, shards, padded", [
    (29, 2, 1, 32), (28, 2, 2, 28), (29, 2, 2, 32),  # tp = 2: every cp shard (2 chunks) already halves
    (10, 2, 3, 12), (13, 2, 3, 24),  # tp = 3: a multiple of lcm(2 cp, cp tp) = 12
    (16, 4, 4, 16), (17, 4, 4, 32)])
def test_the_padding_serves_the_zigzag_and_the_tp_split(seq, cp, shards, padded):
    assert padded_length(seq, cp, shards) == padded
    n = padded // cp
    assert n % 2 == 0 and n % shards == 0  # two equal zig-zag chunks, and tp equal sequence shards


def test_a_shard_cut_again_over_3_tp_ranks_keeps_its_global_positions():
    """13 tokens at cp = 2, tp = 3: padded to 24, each cp shard 12 tokens, 4 per tp rank, no real
    token after a pad; the positions are the zig-zag ones of the padded length."""
    tokens = torch.arange(13)[None]
    for rank in range(2):
        shard, targets, positions = shard_batch(tokens, tokens, 2, rank, sequence_shards=3)
        assert shard.shape == (1, 12) and torch.equal(positions, zigzag_positions(24, 2, rank))
        real = positions < 13
        assert torch.equal(shard[0, real], positions[real]) and (targets[0, ~real] < 0).all()
    assert ContextParallel(None, 2, 0, 64, sequence_shards=3).shard(tokens)[0].shape == (1, 12)


@pytest.mark.parametrize("overrides, world", [
    ([*CP, "parallel.tp=2", "parallel.sequence_parallel=true"], 4),
    ([*CP, "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=29"], 4),  # padded, not refused
    ([*CP, "parallel.tp=2", "model.n_kv_heads=1"], 4),
    ([*CP, "parallel.tp=4"], 8),  # tiny's 2 KV heads, each on 2 of the 4 tp ranks, x cp 2
    (["parallel.tp=2", "model.n_kv_heads=1", "train.parallel=fsdp"], 4),
])
def test_launch_accepts_what_was_refused(overrides, world):
    assert check_launch(make_config("tiny", overrides=overrides), (0, world, 0), cuda_devices=0) == torch.device("cpu")


def plan(capsys, *extra: str) -> dict:
    assert main(["plan", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--hardware", "h100-sxm",
                 "--json", "--cp", "2", "--tp", "2", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_of_tp_x_cp_with_sequence_parallelism(capsys):
    """Sequence parallelism under cp: the residual stream's activations on n / tp tokens (less saved),
    the ring's bytes unchanged (it carries the whole cp shard's K/V after the all-gather)."""
    on, off = plan(capsys, "--sequence-parallel"), plan(capsys)
    assert on["setup"]["sequence_parallel"] and not off["setup"]["sequence_parallel"]
    assert on["memory"]["breakdown_bytes"]["activations"] < off["memory"]["breakdown_bytes"]["activations"]
    assert on["communication"]["context_parallel"] == off["communication"]["context_parallel"]
    assert on["context_parallel"]["tokens_per_rank_per_sequence"] == 32


def test_the_ring_of_a_replicated_kv_head_carries_one_head_per_rank():
    """tp = 2 over one KV head: each rank's ring carries its copy (kv_heads // tp would be 0)."""
    one_kv = make_config("tiny", overrides=["model.n_kv_heads=1"]).model
    assert context_parallel_bytes(one_kv, 1, 32, 2, 4, tp=2) == context_parallel_bytes(one_kv, 1, 32, 2, 4)
