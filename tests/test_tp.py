"""Tensor parallelism's pieces that need no process group: the shards each rank keeps of the whole
model, and the launches refused before any group exists (the numerics with real processes:
tests/test_tp_dist.py)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.parallel.world import check_launch
from lmforge.parallel.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                 apply_tensor_parallel, shard, sharded_dim)


def place(rank: int, world: int = 2):
    """Where a module sits in its tp group: all that building a shard reads (no collective runs)."""
    return SimpleNamespace(rank=rank, world=world)


def test_shard_is_a_contiguous_slice_and_refuses_an_uneven_split():
    t = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(shard(t, 0, 1, 2), t[2:])
    assert torch.equal(shard(t, 1, 2, 3), t[:, 4:])
    with pytest.raises(ValueError, match="does not split"):
        shard(t, 0, 0, 3)


def test_column_and_row_shards_recompose_the_linear():
    """Y = X A split by columns (each rank's output features) and by rows (each rank's input
    features, the partial products summed: what g does), as Shoeybi et al. 2019, eq. 3."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 6, bias=True), nn.Linear(6, 8, bias=True)
    x = torch.randn(3, 8)
    columns = [ColumnParallelLinear(a, place(r)) for r in range(2)]
    rows = [RowParallelLinear(b, place(r)) for r in range(2)]
    assert all(sharded_dim(c.weight) == 0 and sharded_dim(c.bias) == 0 for c in columns)
    assert all(sharded_dim(r.weight) == 1 and sharded_dim(r.bias) is None for r in rows)
    hidden = [c(x) for c in columns]  # no gather: each rank's features
    torch.testing.assert_close(torch.cat(hidden, dim=-1), a(x))
    partial = sum(F.linear(h, r.weight) for h, r in zip(hidden, rows)) + b.bias
    torch.testing.assert_close(partial, b(a(x)))


def test_vocab_parallel_embedding_keeps_its_rows():
    table = nn.Embedding(10, 4)
    halves = [VocabParallelEmbedding(table, place(r)) for r in range(2)]
    assert [h.vocab_start for h in halves] == [0, 5]
    assert torch.equal(torch.cat([h.weight for h in halves]), table.weight)


def test_apply_keeps_names_splits_shapes_and_refuses_twice():
    cfg = make_config("tiny").model
    torch.manual_seed(0)
    whole = Transformer(cfg)
    full = {k: v.clone() for k, v in whole.state_dict().items()}
    model = apply_tensor_parallel(whole, place(1))
    state = model.state_dict(keep_vars=True)
    assert set(state) == set(full)
    for name, t in state.items():
        dim = sharded_dim(t)
        expected = full[name] if dim is None else full[name].chunk(2, dim=dim)[1]
        assert torch.equal(t.detach(), expected), name
    assert model.lm_head.weight is model.tok_embeddings.weight  # still tied
    assert model.blocks["0"].attn.n_heads == 2 and model.blocks["0"].attn.n_kv_heads == 1
    with pytest.raises(LmforgeError, match="already applied"):
        apply_tensor_parallel(model, place(1))


@pytest.mark.parametrize("overrides, env, message", [
    (["parallel.tp=2"], None, "parallel.tp=2 needs 2 processes per model replica"),
    (["parallel.tp=2"], (0, 3, 0), "the world must be"),
    (["parallel.tp=2"], (0, 4, 0), "2 replicas x parallel.tp=2: the replicas share their gradients by "
                                   "train.parallel=ddp"),
    (["parallel.tp=2", "train.parallel=zero2", "optim.name=muon"], (0, 4, 0), "muon does not combine with parallel.tp=2"),
    (["parallel.tp=2", "parallel.cp=2", "train.parallel=ddp", "optim.name=muon"], (0, 4, 0),
     "muon does not combine with parallel.tp=2 and parallel.cp=2"),
    (["parallel.tp=2", "parallel.pp=2", "optim.name=muon"], (0, 4, 0),
     "muon does not combine with parallel.tp=2 and parallel.pp=2"),
    (["parallel.tp=2", "optim.name=adafactor"], (0, 2, 0), "adafactor does not combine with parallel.tp=2: its"),
    (["parallel.tp=3", "model.n_heads=6", "model.n_kv_heads=2", "model.d_model=48"], (0, 3, 0),
     r"must divide the KV heads \(model.n_kv_heads\) = 2 or be a multiple of them"),
    (["parallel.tp=2", "model.vocab_size=511"], (0, 2, 0), "must divide model.vocab_size = 511"),
    (["parallel.tp=2", "parallel.pp=2"], (0, 2, 0), r"the world must be \(stages x replicas x tp\)"),
    (["parallel.tp=2", "parallel.pp=2", "train.parallel=zero2"], (0, 8, 0),
     "zero2 does not combine with parallel.pp=2"),
    (["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "train.pipeline_engine=torch"],
     (0, 4, 0), "does not combine with parallel.sequence_parallel: train.pipeline_engine=torch"),
    (["parallel.tp=2", "train.precision=fp8", "parallel.sequence_parallel=true"], (0, 2, 0),
     "does not combine with train.precision: fp8's split linears would keep the gathered input"),
    (["parallel.tp=2", "train.loss_chunk_tokens=64"], (0, 2, 0), "does not combine with train.loss_chunk_tokens"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.sample_tokens=10"], (0, 2, 0),
     "cannot be split along the sequence"),
    (["parallel.sequence_parallel=true"], None, "set parallel.tp > 1"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"], (0, 2, 0), "use a multiple of 2"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.family=gpt", "model.n_kv_heads=null"], (0, 2, 0),
     "learned positions"),
])
def test_launch_refusals(overrides, env, message):
    cfg = make_config("tiny", overrides=["train.device=cpu", "train.sample_tokens=0", *overrides])
    with pytest.raises(LmforgeError, match=message):
        check_launch(cfg, env, cuda_devices=0)


def test_launches_accepted():
    base = ["train.device=cpu", "train.sample_tokens=0", "parallel.tp=2"]
    assert check_launch(make_config("tiny", overrides=base), (1, 2, 1), 0).type == "cpu"
    assert check_launch(make_config("tiny", overrides=[*base, "train.parallel=ddp"]), (3, 4, 3), 0).type == "cpu"
    for muon in (["optim.name=muon"], ["optim.name=muon", "train.parallel=ddp"]):  # gathered over tp (tp_engine.py)
        assert check_launch(make_config("tiny", overrides=[*base, *muon]), (1, 2 * len(muon), 1), 0).type == "cpu"
    for strategy in ("zero1", "zero2", "zero3", "fsdp"):  # sharded replicas (parallel/tp_engine.py)
        assert check_launch(make_config("tiny", overrides=[*base, f"train.parallel={strategy}"]), (3, 4, 3), 0).type == "cpu"
    # fewer KV heads than ranks (tiny: 2), replicated: alone, or replicas by ddp, ZeRO or FSDP2 (tp_engine.py)
    kv = ["train.device=cpu", "train.sample_tokens=0", "parallel.tp=4"]
    assert check_launch(make_config("tiny", overrides=kv), (1, 4, 1), 0).type == "cpu"
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        assert check_launch(make_config("tiny", overrides=[*kv, f"train.parallel={strategy}"]), (3, 8, 3), 0).type == "cpu"


def test_parallel_tp_must_be_positive():
    with pytest.raises(LmforgeError, match="parallel.tp must be positive"):
        make_config("tiny", overrides=["parallel.tp=0"])
