"""Optimizer state bytes (accounting/memory.py) against Transformer Math 101 and live optimizers."""

import json

import pytest
import torch

from lmforge.accounting.measure import model_state_bytes_measured
from lmforge.accounting.memory import model_state_bytes, parameter_count
from lmforge.accounting.memory import optimizer_state_bytes
from lmforge.accounting.shapes import model_shapes
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.modes import get_policy
from lmforge.model.transformer import Transformer


@pytest.mark.parametrize("optimizer, bytes_per_parameter", [
    ("adamw", 12),  # fp32 copy + momentum + variance
    ("adamw-8bit", 6),  # fp32 copy + two 1-byte states
    ("sgd-momentum", 8),  # fp32 copy + momentum
    ("lion", 8),  # momentum only (Chen et al. 2023): as SGD with momentum
])
def test_bytes_per_parameter_as_transformer_math_101_lists_them(optimizer, bytes_per_parameter):
    """Mixed precision: 4 bytes of fp32 weights (lmforge's fp32 parameters are the copy) plus the
    states. 8-bit states add one fp32 absmax per 2048 values (Dettmers et al. 2022): 2 * 4 / 2048."""
    cfg = make_config("llama3-8b").model
    n = parameter_count(cfg)
    per_parameter = 4 + optimizer_state_bytes(cfg, optimizer, get_policy("bf16-mixed")) / n
    scales = 2 * 4 / 2048 if optimizer == "adamw-8bit" else 0
    assert per_parameter == pytest.approx(bytes_per_parameter + scales, rel=1e-4)


def test_adafactor_states_are_what_hugging_faces_adafactor_holds():
    from transformers.optimization import Adafactor

    cfg = make_config("tiny").model
    model = Transformer(cfg)
    optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    measured = model_state_bytes_measured(model, optimizer)["optimizer_states"]
    assert measured == optimizer_state_bytes(cfg, "adafactor", get_policy("fp32"))
    # factored: far below one fp32 state per parameter
    assert measured < 0.1 * 4 * parameter_count(cfg)


def test_optimizer_states_shard_and_split_like_the_others():
    cfg = make_config("llama3-8b").model
    bf16 = get_policy("bf16-mixed")
    full = model_state_bytes(cfg, bf16, "lion")["optimizer_states"]
    # a tensor rank's own shapes: the norm gains whole (tests/test_tp_accounting.py), the rest halved
    tensor_rank = optimizer_state_bytes(cfg, "lion", bf16, model_shapes(cfg).tensor_rank_shapes(2))
    assert full / 2 < tensor_rank < full / 2 * 1.0001
    assert model_state_bytes(cfg, bf16, "lion", zero_stage=1, dp=8, tp=2)["optimizer_states"] == tensor_rank / 8


def test_plan_optimizer_option(capsys):
    sizes = {}
    for optimizer in ("adamw", "adamw-8bit", "adafactor", "lion", "sgd"):
        assert main(["plan", "--model", "llama3-1b", "--hardware", "a100", "--optimizer", optimizer, "--json"]) == 0
        sizes[optimizer] = json.loads(capsys.readouterr().out)["memory"]["breakdown_bytes"]["optimizer_states"]
    assert sizes["adamw"] > sizes["lion"] > sizes["adamw-8bit"] > sizes["adafactor"] > sizes["sgd"] == 0
    assert main(["plan", "--model", "tiny", "--hardware", "a100", "--optimizer", "adam9"]) == 2
    assert "unknown optimizer 'adam9'" in capsys.readouterr().err
