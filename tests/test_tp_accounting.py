"""The plan's picture of a tensor rank against the model parallel/tp.py really splits (no process
group: building the shards runs no collective), for every architecture tp takes: the accounting's
own rule of what is split (accounting/shapes.py TP_SPLIT) must be the module swap's. The bytes
measured with real processes: tests/test_tp_accounting_dist.py."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from lmforge.accounting.comm import tensor_parallel_communication
from lmforge.accounting.memory import model_state_bytes
from lmforge.accounting.shapes import model_shapes
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.parallel.tp import apply_tensor_parallel, sharded_dim

ARCHITECTURES = {"llama": [], "gpt": ["model.family=gpt", "model.n_kv_heads=null"],
                 "qwen3-like": ["model.qk_norm=true", "model.qkv_bias=true"], "relu2": ["model.mlp=relu2"]}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tensor_rank_shapes_are_those_tp_builds(arch):
    cfg = make_config("tiny", overrides=ARCHITECTURES[arch]).model
    torch.manual_seed(0)
    model = apply_tensor_parallel(Transformer(cfg), SimpleNamespace(rank=1, world=2))
    params = list(dict.fromkeys(model.parameters()))
    shapes = model_shapes(cfg)
    assert shapes.tensor_rank_shapes(2) == tuple(tuple(p.shape) for p in params)
    assert shapes.tp_dims == tuple(sharded_dim(p) for p in params)
    assert model_state_bytes(cfg, tp=2)["parameters"] == sum(p.nbytes for p in params)


@pytest.mark.parametrize("overrides,tp", [([], 4), (["model.n_kv_heads=1"], 2),
                                         (["model.n_kv_heads=1", "model.qkv_bias=true", "model.qk_norm=true"], 4)],
                         ids=["tp4 of 2 KV heads", "tp2 of 1", "tp4 of 1, biases, QK-norm"])
def test_replicated_kv_heads_shapes_are_those_tp_builds(overrides, tp):
    """Fewer KV heads than ranks: every rank's shapes (k and v: one KV head's rows) and bytes."""
    cfg = make_config("tiny", overrides=overrides).model
    for rank in range(tp):
        model = apply_tensor_parallel(Transformer(cfg), SimpleNamespace(rank=rank, world=tp))
        params = list(dict.fromkeys(model.parameters()))
        assert model_shapes(cfg).tensor_rank_shapes(tp) == tuple(tuple(p.shape) for p in params)
        assert model_state_bytes(cfg, tp=tp)["parameters"] == sum(p.nbytes for p in params)


def test_replicated_kv_heads_are_not_the_even_split():
    """What the even split over tp (the plan before replicated KV heads were counted) misses, tiny
    at tp=4 (2 layers, k and v of 32 x 64, fp32): a rank holds half of k and v, not a quarter,
    2 x 2 x 512 elements more; and the copies' all-reduce of the whole projections, twice (an
    all-reduce), per micro-batch. tests/test_tp_replicated_kv_plan_dist.py measures both."""
    cfg = make_config("tiny").model
    shapes = model_shapes(cfg)
    even = dataclasses.replace(shapes, tp_slices=())
    held = (sum(map(math.prod, shapes.tensor_rank_shapes(4))) - sum(map(math.prod, even.tensor_rank_shapes(4))))
    assert held == 2 * 2 * (32 * 64 // 4)
    parts = tensor_parallel_communication(cfg, 4, 64, 4, False, grad_accum=2)["ring_bytes"]
    assert parts["kv_copies"] == 2 * (2 * 2 * 32 * 64) * 4 * 2
    assert "kv_copies" not in tensor_parallel_communication(cfg, 4, 64, 2, False)["ring_bytes"]


def test_tensor_parallel_traffic_by_part():
    """tiny (d 64, 2 layers), b 4, s 64, fp32, one micro-batch: S = 65,536 bytes. Without sequence
    parallelism 4 regions x 2 all-reduces x 2S, the embedding's and head's all-reduce 2S each, the
    loss 3 x 2 x 256 tokens x 4 bytes; with it 5S a region, 2S and 3S, plus the whole parameters'
    gradients all-reduced (5 norm gains of 64: 2 x 320 x 4 bytes)."""
    cfg, S = make_config("tiny").model, 4 * 64 * 64 * 4
    without = tensor_parallel_communication(cfg, 4, 64, 2, False)
    assert without["ring_bytes"] == {"embedding": 2 * S, "layers": 16 * S, "head": 2 * S, "loss": 6144,
                                     "gradient_sums": 0}
    with_sp = tensor_parallel_communication(cfg, 4, 64, 2, True)
    assert with_sp["ring_bytes"] == {"embedding": 2 * S, "layers": 20 * S, "head": 3 * S, "loss": 6144,
                                     "gradient_sums": 2560}
    assert with_sp["sent_bytes"] == sum(with_sp["ring_bytes"].values()) / 2
    assert tensor_parallel_communication(cfg, 4, 64, 1, True)["sent_bytes"] == 0
