"""Tensor parallelism with and without sequence parallelism, as Korthikanti et al. 2022 publish it."""

import json

import pytest

from lmforge.accounting.activations import activation_breakdown, korthikanti_activation_bytes
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.modes import get_policy

# GPT-3 175B as the paper plans it (section 6: s=2048, h=12288, a=96, L=96, t=8), b=1
S, B, H, A, L, T = 2048, 1, 12288, 96, 96, 8
SBHL = S * B * H * L

# Korthikanti et al. 2022, table 2: activation memory per transformer layer, times L, in bytes
TABLE_2 = [
    # (row, recompute, tp, sequence parallel, the row's formula)
    ("no parallelism", "none", 1, False, SBHL * (34 + 5 * A * S / H)),
    ("tensor parallel (baseline)", "none", T, False, SBHL * (10 + 24 / T + 5 * A * S / (H * T))),
    ("tensor + sequence parallel", "none", T, True, SBHL * (34 / T + 5 * A * S / (H * T))),
    ("tensor parallel + selective recompute", "selective", T, False, SBHL * (10 + 24 / T)),
    ("tensor + sequence parallel + selective recompute", "selective", T, True, SBHL * 34 / T),
    ("full activation recomputation", "full", T, False, SBHL * 2),
]


@pytest.mark.parametrize("row, recompute, tp, sp, published", TABLE_2, ids=[row[0] for row in TABLE_2])
def test_every_row_of_korthikanti_table_2(row, recompute, tp, sp, published):
    assert korthikanti_activation_bytes(S, B, H, A, L, recompute, tp, sequence_parallel=sp) == pytest.approx(
        published, rel=1e-12)


def test_full_recomputation_with_sequence_parallelism_splits_the_layer_input():
    # table 2 has no such row: with sequence parallelism the layer input is held s/t per rank (section 4.2.2)
    assert korthikanti_activation_bytes(S, B, H, A, L, "full", T, sequence_parallel=True) == SBHL * 2 / T


def test_lmforge_layers_keep_the_papers_replicated_terms_whole_without_sequence_parallelism():
    """Without SP the paper's 10*s*b*h per layer stays whole on each tensor rank: the two LayerNorm
    inputs (4sbh), the inputs of the QKV and first MLP projections (2sbh each) and two dropout masks
    (sbh each). lmforge's GPT has no dropout and its LayerNorm also keeps mean and 1/std (two values
    per token): in bf16 that is 8sbh + 8bs per layer, whole, where SP would split it t ways."""
    cfg = make_config("tiny", overrides=["model.family=gpt", "model.n_kv_heads=null"]).model
    b, s, t = 2, 32, 2
    sbh, bs = s * b * cfg.d_model, b * s
    with_sp = activation_breakdown(cfg, b, s, get_policy("bf16-pure"), tp=t, sequence_parallel=True)["layers"]
    without = activation_breakdown(cfg, b, s, get_policy("bf16-pure"), tp=t, sequence_parallel=False)["layers"]
    assert without - with_sp == cfg.n_layers * (8 * sbh + 8 * bs) * (1 - 1 / t)
    # full recomputation: the block input (bf16 residual, 2sbh) is whole without SP, split with it
    full = {sp: activation_breakdown(cfg, b, s, get_policy("bf16-pure"), "sdpa", "full", tp=t, sequence_parallel=sp)
            for sp in (True, False)}
    assert full[False]["layers"] == cfg.n_layers * 2 * sbh == full[True]["layers"] * t


def test_plan_command_takes_no_sequence_parallel(capsys):
    args = ["plan", "--model", "gpt3-175b", "--batch-size", "1", "--seq-len", "2048", "--precision", "fp16",
            "--recompute", "selective", "--tp", "8", "--hardware", "a100", "--json",
            # what the trainer (config/rules.py) splits over 8 ranks with sequence parallelism: Megatron's
            # padded vocabulary (50257 to a multiple of 128 x tp) and rotary positions (gpt's learned ones
            # are not written for sequence shards); the shapes of Korthikanti's formula are GPT-3's
            "model.vocab_size=51200", "model.family=llama"]
    plans = {}
    for flag in ("--sequence-parallel", "--no-sequence-parallel"):
        assert main([*args, flag]) == 0
        plans[flag] = json.loads(capsys.readouterr().out)
    assert plans["--sequence-parallel"]["memory"]["activations_korthikanti_bytes"] == SBHL * 34 / T
    assert plans["--no-sequence-parallel"]["memory"]["activations_korthikanti_bytes"] == SBHL * (10 + 24 / T)
    assert plans["--no-sequence-parallel"]["setup"]["sequence_parallel"] is False
    assert (plans["--no-sequence-parallel"]["memory"]["breakdown_bytes"]["activations"]
            > plans["--sequence-parallel"]["memory"]["breakdown_bytes"]["activations"])
