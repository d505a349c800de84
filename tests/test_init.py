"""The initialisation schemes of model/init.py (model.init, model.zero_init_proj) against torch.nn.init.

Every comparison with torch.nn.init is exact (torch.equal): the same generator state must give the
same tensors, so any wrong std, fan or order of draws fails. The one tolerance is in the tied
zero-projection loss, whose prediction leaves the sum of the V - 1 other exponentials at its mean
(explained there).
"""

import math

import pytest
import torch
import torch.nn as nn

from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.model.init import expected_std, init_weights
from lmforge.model.transformer import Transformer


def _model(*overrides: str):
    cfg = make_config("tiny", overrides=list(overrides)).model
    return cfg, Transformer(cfg)


def _reference(model: nn.Module, cfg, linear_init) -> dict[str, torch.Tensor]:
    """What torch.nn.init draws, module by module in the model's order, for each weight and bias."""
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            expected[f"{name}.weight"] = nn.init.normal_(torch.empty_like(module.weight), std=cfg.d_model ** -0.5)
        elif isinstance(module, nn.Linear) and not (name == "lm_head" and cfg.tie_embeddings):
            expected[f"{name}.weight"] = linear_init(name, torch.empty_like(module.weight))
            if module.bias is not None:
                expected[f"{name}.bias"] = torch.zeros_like(module.bias)
    return expected


def _assert_initialised_as(model, cfg, linear_init, seed=7):
    torch.manual_seed(seed)
    init_weights(model, cfg)
    torch.manual_seed(seed)
    expected = _reference(model, cfg, linear_init)
    state = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=false"], ["model.family=gpt", "model.n_kv_heads=null"]])
def test_scaled_normal_is_the_default_and_draws_what_it_always_did(overrides):
    """Today's scheme, drawn as before this change: one normal_ per weight, std from expected_std."""
    cfg, model = _model(*overrides)
    assert cfg.init == "scaled_normal" and not cfg.zero_init_proj
    _assert_initialised_as(model, cfg, lambda name, w: nn.init.normal_(
        w, std=expected_std(f"{name}.weight", tuple(w.shape), cfg.n_layers)))


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=false"], ["model.family=gpt", "model.n_kv_heads=null"]])
def test_xavier_is_torch_xavier_normal(overrides):
    cfg, model = _model("model.init=xavier", *overrides)
    _assert_initialised_as(model, cfg, lambda name, w: nn.init.xavier_normal_(w))
    w = model.blocks["0"].mlp.down_proj.weight
    assert w.std().item() == pytest.approx(math.sqrt(2 / sum(w.shape)), rel=0.1)  # 12k draws: sd of std ~0.6%


@pytest.mark.parametrize("overrides, activated", [
    ([], "gate_proj"),                                   # SwiGLU: the gate feeds SiLU
    (["model.mlp=relu2"], "up_proj"),                    # ReLU^2: the up projection feeds the ReLU
    (["model.family=gpt", "model.n_kv_heads=null"], "up_proj"),  # GELU
])
def test_kaiming_is_torch_kaiming_normal_with_the_relu_gain_where_a_nonlinearity_follows(overrides, activated):
    cfg, model = _model("model.init=kaiming", "model.tie_embeddings=false", *overrides)

    def kaiming(name, w):
        gain = "relu" if name.endswith(f"mlp.{activated}") else "linear"
        return nn.init.kaiming_normal_(w, mode="fan_in", nonlinearity=gain)

    _assert_initialised_as(model, cfg, kaiming)
    layer = getattr(model.blocks["1"].mlp, activated).weight
    assert layer.std().item() == pytest.approx(math.sqrt(2 / layer.shape[1]), rel=0.05)


def test_zero_init_proj_zeroes_the_projections_and_an_untied_head_the_first_loss_is_ln_vocab():
    """o_proj, down_proj and the untied LM head start at zero (modded-nanogpt): every logit is 0, so
    the softmax is uniform and the first loss is ln V exactly (to fp32 rounding of a logsumexp of
    zeros, ~1e-6), not the ln V + 1/2 of random logits of unit variance (init.py). At step 0 only
    the head gets a gradient: the zero head passes none back into the stream."""
    cfg, model = _model("model.zero_init_proj=true", "model.tie_embeddings=false")
    zeroed = [name for name, p in model.named_parameters() if not p.any()]
    assert sorted(zeroed) == sorted(["lm_head.weight"] + [f"blocks.{i}.{proj}.weight" for i in range(cfg.n_layers)
                                                          for proj in ("attn.o_proj", "mlp.down_proj")])
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 65))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1e-5
    loss.backward()
    moving = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    assert moving == {"lm_head.weight"}


def test_zero_init_proj_with_tied_embeddings_makes_the_blocks_the_identity():
    """Tied, the head is the embedding and is not zeroed. The blocks add nothing, so the logits are
    norm(e_t) E^T exactly. Theory for the loss: h = sqrt(d) e_t / |e_t| scores its own token
    sqrt(d) |e_t| (~8 for d = 64) and each other token N(0, 1) (h has norm sqrt(d), rows of E
    variance 1/d), so a next token other than t costs ln(exp(sqrt(d) |e_t|) + (V - 1) e^(1/2)):
    ~8.3 nats here, well above ln V = 6.24. The sum over the V - 1 others is set to its mean; its
    relative spread sqrt((e - 1) / V) ~ 6% moves each term by ~0.01 nats, less over 4096 tokens:
    0.05 nats is the allowance, where the random-projection model's ~6.7 is 1.6 nats away."""
    cfg, model = _model("model.zero_init_proj=true")
    assert all(not model.blocks[str(i)].attn.o_proj.weight.any() and not model.blocks[str(i)].mlp.down_proj.weight.any()
               for i in range(cfg.n_layers))
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (64, 65))
    with torch.no_grad():
        assert torch.equal(model(tokens[:, :-1]), model.head(model.embed(tokens[:, :-1])))
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
        own = math.sqrt(cfg.d_model) * model.tok_embeddings.weight[tokens[:, :-1]].norm(dim=-1)
        predicted = torch.log(own.exp() + (cfg.vocab_size - 1) * math.exp(0.5)).mean().item()
    assert abs(loss - predicted) < 0.05
    assert loss > math.log(cfg.vocab_size) + 1.5


def test_an_unknown_scheme_is_refused_with_the_choices():
    with pytest.raises(LmforgeError, match=r"model.init must be one of scaled_normal, xavier, kaiming.*'xavier'"):
        make_config("tiny", overrides=["model.init=xavir"])
