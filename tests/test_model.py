import math

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.attention import apply_rope, attention, causal_mask, rope_tables
from lmforge.model.init import expected_std
from lmforge.model.transformer import RMSNorm, Transformer


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * g   (Zhang & Sennrich 2019, eq. 4; no mean subtraction)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def test_rmsnorm_matches_the_formula_and_torch():
    x = torch.randn(3, 5, 48, dtype=torch.float64, requires_grad=True)
    ours = RMSNorm(48, eps=1e-5).double()
    ours.weight.data = torch.randn(48, dtype=torch.float64)
    formula = rms_norm_reference(x, ours.weight, 1e-5)
    torch.testing.assert_close(ours(x), formula)
    grad_out = torch.randn_like(formula)
    expected = torch.autograd.grad(formula, (x, ours.weight), grad_out)
    torch.testing.assert_close(torch.autograd.grad(ours(x), (x, ours.weight), grad_out), expected)
    reference = torch.nn.RMSNorm(48, eps=1e-5).double()
    reference.weight.data = ours.weight.data.clone()
    torch.testing.assert_close(ours(x), reference(x))


def test_rmsnorm_computes_low_precision_inputs_in_fp32():
    x = torch.randn(4, 64) * 1e3
    out = RMSNorm(64, eps=1e-5)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rms_norm_reference(x.bfloat16().float(), torch.ones(64), 1e-5),
                               atol=0, rtol=8e-3)  # one bf16 rounding of the output, nothing more


def test_rope_preserves_norms_and_encodes_relative_position():
    cos, sin = rope_tables(head_dim=16, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def rotated(v, pos):
        return apply_rope(v.view(1, 1, 1, 16), cos[pos:pos + 1], sin[pos:pos + 1]).flatten()

    assert torch.allclose(rotated(q, 7).norm(), q.norm(), atol=1e-5)
    # Su et al. eq. 16: <R_m q, R_n k> depends only on m - n.
    assert torch.allclose(rotated(q, 9) @ rotated(k, 4), rotated(q, 25) @ rotated(k, 20), atol=1e-4)
    assert not torch.allclose(rotated(q, 9) @ rotated(k, 4), rotated(q, 9) @ rotated(k, 5), atol=1e-3)


def test_rope_matches_complex_rotation():
    """Rotate-half RoPE equals multiplying (x_j + i x_{j+d/2}) by e^{i m theta_j} (Su et al. eq. 34)."""
    d, pos = 8, 5
    cos, sin = rope_tables(d, 16, 10000.0)
    x = torch.randn(d)
    ours = apply_rope(x.view(1, 1, 1, d), cos[pos:pos + 1], sin[pos:pos + 1]).flatten()
    theta = 10000.0 ** (-torch.arange(0, d, 2).double() / d)
    z = torch.complex(x[: d // 2].double(), x[d // 2:].double()) * torch.exp(1j * pos * theta)
    torch.testing.assert_close(ours, torch.cat([z.real, z.imag]).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, q_len, kv_len, causal", [
    (4, 4, 10, 10, True), (4, 2, 10, 10, True), (6, 1, 7, 7, False),
    (4, 2, 3, 11, True),   # queries continuing a cached prefix
    (4, 2, 1, 9, True),    # one decoding step
])
def test_sdpa_matches_naive_reference(heads, kv_heads, q_len, kv_len, causal):
    torch.manual_seed(0)
    q = torch.randn(2, heads, q_len, 16, dtype=torch.float64)
    k = torch.randn(2, kv_heads, kv_len, 16, dtype=torch.float64)
    v = torch.randn(2, kv_heads, kv_len, 16, dtype=torch.float64)
    expected = attention(q, k, v, causal=causal, backend="naive")
    torch.testing.assert_close(attention(q, k, v, causal=causal, backend="sdpa"), expected)
    # and the naive reference is the textbook formula, with kv head j // group serving query head j
    group = heads // kv_heads
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k_full.transpose(-1, -2) / math.sqrt(16)
    if causal:
        scores = scores.masked_fill(~causal_mask(q_len, kv_len), float("-inf"))
    torch.testing.assert_close(expected, scores.softmax(-1) @ v_full)


def test_causal_mask_is_end_aligned():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_unknown_backend_is_rejected():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        attention(q, q, q, backend="flash")


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_model_is_causal(family):
    cfg = make_config("tiny", overrides=[f"model.family={family}"] + (["model.n_kv_heads=null"] if family == "gpt" else []))
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, cfg.model.vocab_size, (2, 8))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 20, cfg.model.vocab_size)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_naive_and_sdpa_models_agree_in_loss_and_gradients(family):
    overrides = [f"model.family={family}"] + (["model.n_kv_heads=null"] if family == "gpt" else [])
    losses, grads = [], []
    for backend in ("naive", "sdpa"):
        cfg = make_config("tiny", overrides=overrides + [f"model.attention={backend}"])
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_llama_block_structure():
    cfg = make_config("tiny").model
    model = Transformer(cfg)
    names = dict(model.named_parameters())
    assert not any(n.endswith("bias") for n in names)  # Llama has no biases
    assert names["blocks.0.attn.k_proj.weight"].shape == (cfg.kv_heads * cfg.head_dim, cfg.d_model)  # GQA
    assert names["blocks.0.mlp.gate_proj.weight"].shape == (cfg.ffn_dim, cfg.d_model)
    assert model.lm_head.weight is model.tok_embeddings.weight  # tied
    assert model.num_params() == sum(p.numel() for p in names.values())


def test_gpt_block_structure():
    cfg = make_config("gpt2-124m", overrides=["model.n_layers=1", "model.vocab_size=1000"]).model
    model = Transformer(cfg)
    names = dict(model.named_parameters())
    assert names["blocks.0.mlp.up_proj.bias"].shape == (4 * 768,)
    assert names["pos_embeddings.weight"].shape == (1024, 768)
    assert isinstance(model.norm, torch.nn.LayerNorm)


def test_positions_beyond_max_seq_len_are_refused():
    cfg = make_config("tiny").model
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_initialisation_statistics():
    cfg = make_config("small").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    for name, param in model.named_parameters():
        if param.ndim == 1:  # normalisation gains
            assert name.endswith("norm.weight") and torch.all(param == 1), name
            continue
        std = expected_std(name, tuple(param.shape), cfg.n_layers)
        assert abs(param.mean().item()) < 4 * std / math.sqrt(param.numel()), name
        assert abs(param.std().item() / std - 1) < 0.02, (name, param.std().item(), std)
    # residual projections are scaled down by sqrt(2 * n_layers)
    o = model.blocks["0"].attn.o_proj.weight
    q = model.blocks["0"].attn.q_proj.weight
    assert abs(q.std() / o.std() / math.sqrt(2 * cfg.n_layers) - 1) < 0.03


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_initial_loss_is_log_vocab_plus_half(family):
    """N(0, 1/d) head rows (tied to the embeddings, or not) read a unit-RMS final hidden state h:
    each logit h.e_j has variance |h|^2 / d = 1. For V logits iid N(0, s^2),
    E[logsumexp] = ln V + s^2/2 - (e^{s^2} - 1)/(2V) + ... (the delta method on the sum of
    exponentials), and a uniformly random target's logit averages to 0: the initial loss is
    ln V + 1/2, half a nat above a uniform guess (init.py)."""
    overrides = [f"model.family={family}"] + (["model.n_kv_heads=null"] if family == "gpt" else [])
    cfg = make_config("small", overrides=overrides).model
    vocab = cfg.vocab_size
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, vocab, (4, 129))
    with torch.no_grad():
        logits = model(tokens[:, :-1]).double()
    # unit variance, up to the sampling error of V normal numbers' variance (relative std sqrt(2/V))
    assert abs(logits.var().item() - 1) < 3 * math.sqrt(2 / vocab)
    # the loss for a uniformly random target, without the noise of sampling one, against its expectation
    uniform = (torch.logsumexp(logits, -1) - logits.mean(-1)).mean().item()
    variance = logits.var(-1)
    expected = (math.log(vocab) + variance / 2 - (variance.exp() - 1) / (2 * vocab)).mean().item()
    assert abs(uniform - expected) < 0.01
    assert abs(uniform - (math.log(vocab) + 0.5)) < 0.05
    # the loss with these sampled targets: that, give or take the standard error of its mean
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    assert abs(per_token.mean().item() - uniform) < 4 * per_token.std().item() / math.sqrt(per_token.numel())
    with torch.no_grad():
        assert model(tokens[:, :-1], tokens[:, 1:]).item() == pytest.approx(per_token.mean().item(), rel=1e-6)


def test_the_residual_stream_does_not_blow_up_with_depth():
    cfg = make_config("small").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 129))
    hidden = model.tok_embeddings(tokens[:, :-1])
    for block in model.blocks.values():
        hidden = block(hidden, model.rope(0, 128))
    assert hidden.pow(2).mean().sqrt() < 3 * model.tok_embeddings.weight.pow(2).mean().sqrt() + 1
