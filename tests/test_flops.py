import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from lmforge.accounting.shapes import (forward_flops_breakdown, forward_flops_per_token, hardware_flops_per_token,
                                      palm_flops_per_token, six_n_flops_per_token, training_flops_per_token)
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.wrap import apply_recompute


def count_flops(fn) -> int:
    """The measurement the FLOP formulas are checked against (here, not in lmforge/accounting: only
    tests use it). Total FLOPs counted by FlopCounterMode while fn() runs.

    On CPU, SDPA runs as the fused op `_scaled_dot_product_flash_attention_for_cpu`, for which
    PyTorch registers no formula: without one, attention would count zero. This counter is given
    PyTorch's own SDPA formulas for it (not ours, so the check stays independent), for this
    measurement only: torch's global FLOP registry is left as it was. Note that the backward
    formula includes recomputing QK^T, as a fused kernel really does (Dao 2023, algorithm 2):
    that is hardware FLOPs, one attention-scores matmul more than the model FLOPs of MFU.
    """
    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    aten = torch.ops.aten
    counter = FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("overrides, seq_len", [
    ([], 64),                                                                     # tiny llama, GQA 4:2
    (["model.n_layers=3", "model.d_model=96", "model.n_heads=6", "model.n_kv_heads=3"], 48),
    (["model.n_kv_heads=1", "model.d_ff=200", "model.tie_embeddings=false"], 17),  # MQA, odd length
    (["model.family=gpt", "model.n_kv_heads=null"], 64),                           # biases, GELU MLP
    (["model.d_model=128", "model.n_heads=2", "model.max_seq_len=256"], 256),     # attention-heavy
    (["model.mlp=relu2"], 64),                                                     # ReLU^2: 2 matrices of 4d
    (["model.mlp=relu2", "model.d_ff=100", "model.logit_softcap=30", "model.tie_embeddings=false"], 33),
    (["model.family=gpt", "model.n_kv_heads=null", "model.mlp=swiglu", "model.qk_norm=false"], 40),
    (["model.qk_norm=true", "model.init=kaiming", "model.zero_init_proj=true"], 64),  # no matmul added
])
def test_analytic_training_flops_match_flop_counter(overrides, seq_len):
    # the naive backend, so that attention runs as matmuls FlopCounterMode has formulas for
    cfg = make_config("tiny", overrides=overrides + ["model.attention=naive"]).model
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len + 1))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    measured = counter.get_total_flops() / tokens[:, :-1].numel()
    assert training_flops_per_token(cfg, seq_len) == measured  # the count is exact: every matmul, nothing else
    assert training_flops_per_token(cfg, seq_len) == 3 * forward_flops_per_token(cfg, seq_len)


def test_palm_formula_for_a_published_shape():
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B), N the non-embedding matrices plus the
    head, agrees with the per-component count for Llama-2 7B."""
    cfg = make_config("llama2-7b").model
    seq_len = 4096
    with torch.device("meta"):
        n = Transformer(cfg).num_params(embeddings=False)
    n_matrices = n - cfg.n_layers * 2 * cfg.d_model - cfg.d_model  # norm gains are not matmul weights
    palm = 6 * n_matrices + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    assert training_flops_per_token(cfg, seq_len) == palm


def _measured_flops_per_token(model, batch, seq):
    inputs, targets = torch.randint(0, model.cfg.vocab_size, (2, batch, seq))
    return count_flops(lambda: model(inputs, targets).backward()) / (batch * seq)


def test_fused_cpu_sdpa_is_counted_not_missed():
    """FlopCounterMode has no formula for the fused CPU kernel; count_flops registers PyTorch's
    own, whose backward also recomputes QK^T (hardware FLOPs): model FLOPs + one QK^T."""
    cfg = make_config("tiny", overrides=["model.d_model=128", "model.n_heads=2", "model.max_seq_len=256"]).model
    measured = _measured_flops_per_token(Transformer(cfg), 2, 256)
    predicted = training_flops_per_token(cfg, 256) + forward_flops_breakdown(cfg, 256)["attention_scores_qk"]
    assert measured == predicted


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_hardware_flops_count_the_recomputed_forward(recompute):
    cfg = make_config("tiny", overrides=["model.attention=naive"]).model
    model = apply_recompute(Transformer(cfg), recompute)
    measured = _measured_flops_per_token(model, 2, 64)
    assert measured == hardware_flops_per_token(cfg, 64, recompute)
    assert hardware_flops_per_token(cfg, 64, recompute) > training_flops_per_token(cfg, 64)


@pytest.mark.parametrize("attention", ["sdpa", "flash_torch"])
def test_selective_recomputation_reruns_a_fused_attention_op_whole(attention):
    """A fused op (one autograd node) is rerun whole, QK^T and AV; the extra FLOPs over no
    recomputation are what the formula adds (the kernels' own backward work cancels out)."""
    cfg = make_config("tiny", overrides=[f"model.attention={attention}"]).model
    measured = {mode: _measured_flops_per_token(apply_recompute(Transformer(cfg), mode), 2, 64)
                for mode in ("none", "selective")}
    predicted = {mode: hardware_flops_per_token(cfg, 64, mode) for mode in ("none", "selective")}
    assert measured["selective"] - measured["none"] == predicted["selective"] - predicted["none"]


def test_breakdown_components_and_the_causal_option():
    cfg = make_config("llama3-8b").model
    parts = forward_flops_breakdown(cfg, 8192)
    assert set(parts) == {"qkv_projections", "output_projection", "attention_scores_qk", "attention_values_av",
                          "mlp", "lm_head"}
    assert parts["mlp"] == 32 * 3 * 2 * 4096 * 14336
    assert parts["qkv_projections"] == 32 * 2 * 4096 * 128 * (32 + 2 * 8)
    halved = forward_flops_breakdown(cfg, 8192, causal=True)
    assert halved["attention_scores_qk"] * 2 == parts["attention_scores_qk"]
    assert halved["mlp"] == parts["mlp"]
    # 6N misses the attention matmuls, which at 8k context are a visible share
    assert six_n_flops_per_token(cfg) < training_flops_per_token(cfg, 8192) == palm_flops_per_token(cfg, 8192)
    with pytest.raises(ValueError, match="unknown recompute mode"):
        hardware_flops_per_token(cfg, 128, "sometimes")


def test_a_changed_model_is_counted_without_touching_the_accounting(monkeypatch):
    """The matmul shapes are read from the model: a llama with a GELU MLP (two matrices instead of
    SwiGLU's three) is counted exactly, with no change to shapes.py."""
    import dataclasses

    from lmforge.accounting import shapes
    from lmforge.model import transformer

    monkeypatch.setitem(transformer.FAMILIES, "llama",
                        dataclasses.replace(transformer.FAMILIES["llama"], mlp=transformer.GeluMLP))
    cfg = make_config("tiny", overrides=["model.attention=naive", "model.d_model=80"]).model
    shapes._shapes.cache_clear()  # the shapes of this config must be read from the changed model
    try:
        model = Transformer(cfg)
        assert not hasattr(model.blocks["0"].mlp, "gate_proj")
        tokens = torch.randint(0, cfg.vocab_size, (2, 33))
        counter = FlopCounterMode(display=False)
        with counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        assert training_flops_per_token(cfg, 32) == counter.get_total_flops() / tokens[:, :-1].numel()
    finally:
        shapes._shapes.cache_clear()


@pytest.mark.parametrize("overrides, targets", [
    ([], "q_proj,k_proj,v_proj,o_proj"),          # the default: the first block's q, k, v get no input gradient
    ([], "down_proj"),                             # nothing before block 0's down projection needs a gradient
    ([], "v_proj"),                                # dQ and dK of the first block's QK^T are skipped
    ([], "*"),                                     # every linear of the blocks
    ([], "blocks.1.mlp.*"),                        # block 0 runs no backward at all
    (["model.family=gpt", "model.n_kv_heads=null"], "q_proj,v_proj"),
    (["model.tie_embeddings=false"], "up_proj,o_proj"),
])
def test_lora_training_flops_match_flop_counter(overrides, targets):
    """Issue 26, part 3: a frozen linear layer computes no weight gradient, an adapter adds its own
    matmuls, and autograd skips the gradients nothing trainable needs; counted exactly."""
    from lmforge.modes import get_policy
    from lmforge.train.setup import build_model

    cfg = make_config("tiny", overrides=[*overrides, "model.attention=naive", "finetune.lora_rank=4",
                                         f"finetune.lora_targets={targets}"])
    model = build_model(cfg, get_policy("fp32"))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    lora = training_flops_per_token(cfg.model, 64, lora=(4, targets))
    assert lora == counter.get_total_flops() / tokens[:, :-1].numel()
    assert lora < training_flops_per_token(cfg.model, 64)


def test_the_plan_prints_lora_flops_and_times_with_them():
    from lmforge.accounting.plan.make import Costing, make_plan
    from lmforge.config import FinetuneConfig

    TARGETS = FinetuneConfig().lora_targets

    cfg = make_config("small").model
    full, lora = (make_plan(make_config("small", overrides=[f"finetune.lora_rank={rank}"]),
                            Costing(hardware="h100-sxm")) for rank in ("null", 16))
    assert full["flops"]["training_per_token"] == pytest.approx(37.55e6, rel=1e-3)
    assert lora["flops"]["training_per_token"] == training_flops_per_token(cfg, 256, lora=(16, TARGETS))
    ratio = lora["flops"]["training_per_token"] / full["flops"]["training_per_token"]
    assert lora["time"]["seconds_per_step"] == pytest.approx(full["time"]["seconds_per_step"] * ratio)
    assert lora["budget"]["training_flops"] == pytest.approx(full["budget"]["training_flops"] * ratio)
