"""The memory formulas against what autograd, the optimizer and the KV cache really hold."""

import pytest
import torch

from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.accounting.activations import activation_breakdown, korthikanti_activation_bytes
from lmforge.accounting.memory import (kv_cache_bytes, model_state_bytes, parameter_count,
                                       zero_paper_model_state_bytes)
from lmforge.config import make_config
from lmforge.generate.sampling import KVCache
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.modes import POLICIES, get_policy
from lmforge.precision.policy import autocast, prepare_model
from lmforge.wrap import apply_recompute

CONFIGS = {
    "tiny-gqa": [],
    "deeper-wider": ["model.n_layers=3", "model.d_model=96", "model.n_heads=6", "model.n_kv_heads=3"],
    "mqa-odd-ffn": ["model.n_kv_heads=1", "model.d_ff=200", "model.vocab_size=300", "model.tie_embeddings=false"],
    "gpt": ["model.family=gpt", "model.n_kv_heads=null"],
    "qwen-choices": ["model.qk_norm=true", "model.d_head=32", "model.qkv_bias=true"],  # QK-norm's saved tensors
    "window": ["model.sliding_window=8"],  # sdpa keeps the band as an s x s mask
    "relu2": ["model.mlp=relu2"],  # a llama with the speedrun's two-matrix MLP (model/recipe.py)
    "gpt-swiglu": ["model.family=gpt", "model.n_kv_heads=null", "model.mlp=swiglu"],
    "softcap": ["model.logit_softcap=30"],  # the capped head keeps tanh's output
}
PRECISIONS = list(POLICIES)


def build(cfg, precision="fp32", recompute="none"):
    model = Transformer(cfg)
    prepare_model(model, get_policy(precision))
    return apply_recompute(model, recompute)


def saved_activation_bytes(model, batch, seq, precision):
    inputs, targets = torch.randint(0, model.cfg.vocab_size, (2, batch, seq))
    with autocast(get_policy(precision), torch.device("cpu")):
        with measure_saved_bytes(model.parameters()) as saved:
            loss = model(inputs, targets)
    loss.backward()  # the graph must really be usable
    return saved.activations


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash_torch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_activation_bytes_match_what_autograd_saves(name, attention, precision):
    cfg = make_config("tiny", overrides=[*CONFIGS[name], f"model.attention={attention}"]).model
    batch, seq = 3, 48
    measured = saved_activation_bytes(build(cfg, precision), batch, seq, precision)
    predicted = activation_breakdown(cfg, batch, seq, get_policy(precision), attention)
    predicted.pop("recomputed_layer", None)
    assert sum(predicted.values()) == pytest.approx(measured, rel=0.05)
    assert abs(sum(predicted.values()) - measured) <= 8  # counted tensor by tensor: exact but the loss's scalar


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_policy_saves_what_the_formula_says(family, recompute, precision):
    """Issue "mixed precision", part 4: each policy's bytes per activation, against autograd."""
    cfg = make_config("tiny", overrides=[f"model.family={family}"] + (["model.n_kv_heads=null"] if family == "gpt" else [])).model
    measured = saved_activation_bytes(build(cfg, precision, recompute), 3, 48, precision)
    predicted = activation_breakdown(cfg, 3, 48, get_policy(precision), "sdpa", recompute)
    predicted.pop("recomputed_layer", None)
    assert sum(predicted.values()) == pytest.approx(measured, rel=0.05)
    assert abs(sum(predicted.values()) - measured) <= 8  # counted tensor by tensor, for both families


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-pure"])
def test_fp32_attention_saves_what_the_formula_says(attention, recompute, precision):
    cfg = make_config("tiny", overrides=[f"model.attention={attention}"]).model
    model = Transformer(cfg)
    prepare_model(model, get_policy(precision), fp32_attention=True)
    apply_recompute(model, recompute)
    measured = saved_activation_bytes(model, 3, 48, precision)
    predicted = activation_breakdown(cfg, 3, 48, get_policy(precision), attention, recompute, fp32_attention=True)
    assert abs(sum(predicted.values()) - measured) <= 8
    if precision != "fp32" and recompute == "none":  # the fp32 copies cost bytes
        assert measured > sum(activation_breakdown(cfg, 3, 48, get_policy(precision), attention, recompute).values())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_policy_stores_the_predicted_model_states(precision):
    cfg = make_config("tiny").model
    model = build(cfg, precision)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    with autocast(get_policy(precision), torch.device("cpu")):
        loss = model(*torch.randint(0, cfg.vocab_size, (2, 2, 16)))
    loss.backward()
    optimizer.step()
    predicted = model_state_bytes(cfg, get_policy(precision), "adamw")
    assert model_state_bytes_measured(model, optimizer) == {
        "parameters": predicted["parameters"], "gradients": predicted["gradients"],
        "optimizer_states": predicted["optimizer_states"]}
    fp32 = model_state_bytes(cfg, get_policy("fp32"), "adamw")
    assert sum(predicted.values()) == sum(fp32.values()) * (0.5 if precision == "bf16-pure" else 1)


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_recomputation_saves_what_the_formula_says_and_the_same_gradients(recompute, attention):
    cfg = make_config("tiny", overrides=[f"model.attention={attention}"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    inputs, targets = torch.randint(0, cfg.vocab_size, (2, 3, 48))
    model(inputs, targets).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_recompute(model, recompute)
    with measure_saved_bytes(model.parameters()) as saved:
        loss = model(inputs, targets)
    loss.backward()
    for param, expected in zip(model.parameters(), reference):
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6)
    predicted = activation_breakdown(cfg, 3, 48, get_policy("fp32"), attention, recompute)
    predicted.pop("recomputed_layer", None)
    assert abs(sum(predicted.values()) - saved.activations) <= 8
    none = sum(activation_breakdown(cfg, 3, 48, get_policy("fp32"), attention).values())
    assert saved.activations < none


def test_naive_attention_grows_quadratically_and_sdpa_linearly():
    cfg = make_config("tiny", overrides=["model.max_seq_len=4096"]).model
    per_layer = {a: [activation_breakdown(cfg, 1, s, get_policy("fp32"), a)["layers"] for s in (1024, 2048, 4096)]
                 for a in ("naive", "sdpa")}
    assert per_layer["sdpa"][2] / per_layer["sdpa"][1] == 2.0  # every term is linear in s
    assert per_layer["naive"][2] / per_layer["naive"][1] > 3.5  # dominated by s^2: tends to 4


@pytest.mark.parametrize("name", ["tiny-gqa", "mqa-odd-ffn", "gpt"])
def test_parameters_gradients_and_adamw_states_are_exact(name):
    cfg = make_config("tiny", overrides=CONFIGS[name]).model
    model = Transformer(cfg)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    measured = model_state_bytes_measured(model, optimizer)
    predicted = model_state_bytes(cfg, get_policy("fp32"), "adamw")
    assert measured == {"parameters": predicted["parameters"], "gradients": predicted["gradients"],
                        "optimizer_states": predicted["optimizer_states"]}
    assert predicted["master_weights"] == 0


@pytest.mark.parametrize("optimizer, states", [("sgd", 0), ("sgd-momentum", 1)])
def test_sgd_states_match_torch_sgd(optimizer, states):
    cfg = make_config("tiny").model
    model = Transformer(cfg)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if states else 0.0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    sgd.step()
    assert model_state_bytes_measured(model, sgd)["optimizer_states"] == \
        model_state_bytes(cfg, get_policy("fp32"), optimizer)["optimizer_states"]


def test_zero_paper_figures():
    """Rajbhandari et al. 2020, figure 1: a 7.5B model on 64 GPUs with K = 12 takes 120 GB
    unpartitioned, 31.4 GB with P_os, 16.6 GB with P_os+g and 1.9 GB with P_os+g+p."""
    n = 7.5e9
    expected = [120, 31.4, 16.6, 1.9]
    for stage, gigabytes in enumerate(expected):
        assert zero_paper_model_state_bytes(n, stage, dp=64) / 1e9 == pytest.approx(gigabytes, abs=0.06)


def test_zero_stages_divide_the_right_terms():
    cfg = make_config("llama3-8b").model
    full = model_state_bytes(cfg, get_policy("bf16-mixed"), "adamw", zero_stage=0, dp=8)
    stage = {s: model_state_bytes(cfg, get_policy("bf16-mixed"), "adamw", zero_stage=s, dp=8) for s in (1, 2, 3)}
    assert stage[1]["optimizer_states"] == full["optimizer_states"] / 8
    # under a mixed policy the stages use the paper's layout (section 3.1): 16-bit weights and
    # gradients, the fp32 master weights sharded with m and v -> 2 + 2 + 12/N_d bytes per parameter
    n = full["parameters"] / 4  # fp32 parameters in the one-process layout
    assert stage[1]["parameters"] == 2 * n and stage[1]["gradients"] == 2 * n
    assert stage[1]["master_weights"] + stage[1]["optimizer_states"] == 12 * n / 8
    assert stage[2]["gradients"] == stage[1]["gradients"] / 8 and stage[2]["parameters"] == stage[1]["parameters"]
    assert stage[3]["parameters"] == stage[1]["parameters"] / 8
    with pytest.raises(ValueError, match="ZeRO stage must be"):
        model_state_bytes(cfg, zero_stage=4)
    with pytest.raises(ValueError, match="unknown optimizer"):
        model_state_bytes(cfg, optimizer="adam9")
    with pytest.raises(ValueError, match="unknown precision"):
        model_state_bytes(cfg, get_policy("int4"))


def test_gpt3_175b_worked_example():
    """Korthikanti et al. 2022: GPT-3 175B at s=2048, b=128, 16-bit, no recomputation."""
    cfg = make_config("gpt3-175b").model
    activations = korthikanti_activation_bytes(2048, 128, cfg.d_model, cfg.n_heads, cfg.n_layers)
    assert activations == 35_253_091_565_568
    assert activations / (2 * parameter_count(cfg)) == pytest.approx(101, abs=0.5)
    assert korthikanti_activation_bytes(2048, 128, 12288, 96, 96, recompute="selective") == 96 * 34 * 2048 * 128 * 12288
    assert korthikanti_activation_bytes(2048, 128, 12288, 96, 96, recompute="full") == 96 * 2 * 2048 * 128 * 12288
    # tensor parallel 8 with sequence parallelism divides everything by 8 (eq. 5)
    assert korthikanti_activation_bytes(2048, 128, 12288, 96, 96, tp=8) * 8 == activations


def test_kv_cache_formula_matches_the_cache_generation_uses():
    cfg = make_config("tiny").model
    model = Transformer(cfg)
    cache = KVCache(cfg.n_layers, 2, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim, torch.bfloat16, torch.device("cpu"))
    model.to(torch.bfloat16)(torch.randint(0, cfg.vocab_size, (2, 5)), kv_cache=cache)
    held = cache.keys.nbytes + cache.values.nbytes
    assert held == kv_cache_bytes(cfg, 2, cfg.max_seq_len, dtype_bytes=2)
