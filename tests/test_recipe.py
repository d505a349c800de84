"""The recipe switches (docs/recipe.md): ReLU^2 MLP, logit soft-capping (plain and chunked loss),
QK-norm on the default llama family, the warmup-stable-decay schedule, and the HF export refusing
what it cannot represent.

Tolerances: the chunked loss against the plain one in fp32 is held to rel 1e-5, as in
tests/test_chunked_loss.py (the same sums grouped by chunk; a missing tanh derivative is O(1)
off at the caps used here, where |z| ~ cap). Everything else is exact.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lmforge.accounting.shapes import forward_flops_breakdown
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.data.corpus import END_OF_TEXT, train_tokenizer
from lmforge.interop.hf import export_hf
from lmforge.model.recipe import ReLU2MLP, SoftcapHead
from lmforge.model.transformer import IGNORE_INDEX, RMSNorm, Transformer, cross_entropy_loss
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.wrap import _ChunkedCrossEntropy, apply_chunked_loss
from tests.conftest import tiny_overrides


def test_relu2_mlp_is_relu_squared_two_matrices_4d_wide():
    cfg = make_config("tiny", overrides=["model.mlp=relu2"]).model
    model = Transformer(cfg)
    mlp = model.blocks["0"].mlp
    assert isinstance(mlp, ReLU2MLP) and cfg.ffn_dim == 4 * cfg.d_model and not hasattr(mlp, "gate_proj")
    assert mlp.up_proj.bias is None and mlp.down_proj.bias is None
    x = torch.randn(3, 5, cfg.d_model)
    expected = (torch.clamp(x @ mlp.up_proj.weight.t(), min=0) ** 2) @ mlp.down_proj.weight.t()
    assert torch.allclose(mlp(x), expected, rtol=1e-6, atol=1e-7)  # the same ops, fp32 summation order
    # two 4d matrices hold as many weights as SwiGLU's three of 8d/3 (here 192 = 8*64/3 rounded up to 64)
    swiglu = make_config("tiny").model
    assert 2 * 4 * cfg.d_model == 8 * cfg.d_model and 3 * swiglu.ffn_dim == 9 * cfg.d_model
    # the FLOP count reads the two matrices from the model (tests/test_flops.py checks it against FlopCounterMode)
    assert forward_flops_breakdown(cfg, 64)["mlp"] == cfg.n_layers * 2 * 2 * cfg.d_model * 4 * cfg.d_model
    assert forward_flops_breakdown(swiglu, 64)["mlp"] == swiglu.n_layers * 3 * 2 * swiglu.d_model * swiglu.ffn_dim


def test_softcap_head_caps_the_logits_and_keeps_the_plain_weight():
    cfg = make_config("tiny", overrides=["model.logit_softcap=2"]).model
    model = Transformer(cfg)
    assert isinstance(model.lm_head, SoftcapHead) and model.lm_head.weight is model.tok_embeddings.weight
    assert "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False))
    x = torch.randn(2, 7, cfg.d_model) * 10
    raw = F.linear(x, model.lm_head.weight)
    assert torch.equal(model.lm_head(x), 2 * torch.tanh(raw / 2))
    assert model.lm_head(x).abs().max() <= 2 and raw.abs().max() > 4


@pytest.mark.parametrize("chunk", [1, 37, 1000])
def test_the_chunked_loss_of_a_soft_capped_head_equals_the_plain_one(chunk):
    torch.manual_seed(0)
    n, d, v, cap = 150, 32, 700, 3.0
    h0, w0, y = torch.randn(n, d), torch.randn(v, d) * 0.5, torch.randint(0, v, (n,))
    y[::7] = IGNORE_INDEX  # left-out targets are left out as the plain loss does

    def grads(loss_fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = loss_fn(h, w)
        (3.0 * loss).backward()  # an incoming gradient other than 1
        return [t.detach() for t in (loss, h.grad, w.grad)]

    # the plain path: SoftcapHead's formula (checked above), then the plain cross-entropy
    reference = grads(lambda h, w: cross_entropy_loss(cap * torch.tanh(F.linear(h, w) / cap)[None], y[None]))
    chunked = grads(lambda h, w: _ChunkedCrossEntropy.apply(h, w, y, chunk, cap))
    uncapped = grads(lambda h, w: _ChunkedCrossEntropy.apply(h, w, y, chunk, None))
    for got, want, other in zip(chunked, reference, uncapped):
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        assert ((other - want).norm() / want.norm()).item() > 1e-2  # the cap matters at this scale


def test_a_soft_capped_model_trains_the_same_with_the_chunked_loss():
    cfg = make_config("tiny", overrides=["model.logit_softcap=1.5", "model.tie_embeddings=false"]).model
    torch.manual_seed(0)
    plain = Transformer(cfg)
    chunked = apply_chunked_loss(Transformer(cfg), 16)
    chunked.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 65))
    losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (plain, chunked)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-5 * losses[0].item()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert ((p.grad - q.grad).norm() / p.grad.norm()).item() < 1e-5, name


def test_qk_norm_works_on_the_default_llama_family():
    """model.qk_norm (built for Qwen3) on the default llama: each head's query and key reach the
    attention core at unit RMS (gain 1 at init), whatever the projections' scale."""
    cfg = make_config("tiny", overrides=["model.qk_norm=true"]).model
    model = Transformer(cfg)
    attn = model.blocks["0"].attn
    assert isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
    seen = {}
    attn.core.register_forward_hook(lambda module, args, out: seen.update(q=args[0], k=args[1]))
    with torch.no_grad():
        attn.q_proj.weight.mul_(50)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        model(tokens)
    for t in seen.values():  # RoPE rotates pairs, so the RMS over a head's d features is kept
        assert torch.allclose(t.pow(2).mean(-1).sqrt(), torch.ones(()), atol=1e-3)  # eps 1e-5 under the root


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    lr = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=20, kind="wsd", decay_fraction=0.2)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the cosine's warmup
    assert all(lr(s) == 1.0 for s in range(3, 16))  # stable to S = D - 1 - round(0.2 * 20) = 15
    assert [lr(s) for s in range(15, 21)] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1, 0.1], rel=1e-12)
    assert lr(1000) == pytest.approx(0.1, rel=1e-12)
    never = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=20, kind="wsd", decay_fraction=0.0)
    assert [never(s) for s in range(3, 25)] == [1.0] * 22
    whole = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=20, kind="wsd", decay_fraction=1.0)
    assert [whole(s) for s in (3, 4, 19)] == pytest.approx([1.0, 1.0 - 0.9 / 16, 0.1], rel=1e-12)
    cosine = Schedule(peak=1.0, floor=0.1, warmup_steps=4, decay_steps=20)
    assert cosine(3) == 1.0 and cosine(4) < 1.0 and cosine.kind == "cosine"
    assert resume_note(10, cosine, lr, 20).startswith("the learning rate jumps") and "optim.schedule cosine -> wsd" \
        in resume_note(10, cosine, lr, 20)


def test_wsd_comes_from_the_config_and_a_bad_fraction_is_refused():
    cfg = make_config("tiny", overrides=["optim.schedule=wsd", "optim.decay_fraction=0.5", "train.max_steps=10",
                                         "optim.warmup_steps=0"])
    lr = Schedule.of(cfg)
    assert (lr.kind, lr.decay_steps) == ("wsd", 10)
    assert [lr(s) for s in range(5)] == [cfg.optim.lr] * 5 and lr(5) < cfg.optim.lr
    with pytest.raises(LmforgeError, match=r"optim.decay_fraction must be in \[0, 1\], got 1.5"):
        make_config("tiny", overrides=["optim.schedule=wsd", "optim.decay_fraction=1.5"])
    with pytest.raises(LmforgeError, match="optim.schedule must be one of cosine, wsd"):
        make_config("tiny", overrides=["optim.schedule=linear"])


@pytest.mark.parametrize("switch, words", [("model.mlp=relu2", "model.mlp=relu2 cannot be exported"),
                                           ("model.logit_softcap=30", "model.logit_softcap=30 cannot be exported")])
def test_hf_export_refuses_a_switch_it_cannot_represent(switch, words, tmp_path):
    cfg = make_config("tiny", overrides=[switch]).model
    tokenizer = train_tokenizer(["def f(x):\n    return x\n" * 20] * 5, cfg.vocab_size)
    with pytest.raises(LmforgeError, match=words) as err:
        export_hf(cfg, Transformer(cfg).state_dict(), tokenizer, tmp_path / "hf", end_token=END_OF_TEXT)
    assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()  # one line, nothing written


@pytest.mark.slow  # a subprocess run on the prepared corpus: ~30-50 s on the busy 2-core machine
def test_the_recipe_trains_from_the_command_line(tmp_path, corpus_dir, data_dir):
    """docs/recipe.md's command, shortened: relu2, softcap, zero-init projections, wsd, chunked loss."""
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=6, eval_interval=0, checkpoint_interval=0,
                               log_interval=1)
    result = subprocess.run([sys.executable, "-m", "lmforge", "train", "--model", "tiny", "--no-progress",
                             "--out", str(tmp_path / "run"), *overrides, "model.mlp=relu2", "model.logit_softcap=30",
                             "model.zero_init_proj=true", "model.tie_embeddings=false", "optim.schedule=wsd",
                             "train.loss_chunk_tokens=64"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "mlp: relu2" in config and "schedule: wsd" in config and "logit_softcap: 30" in config
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if r.get("train_loss") is not None]
    assert losses and all(math.isfinite(x) for x in losses)
    # zero projections and a zero untied head: the first step's loss (logged at step 1) is ln V
    assert abs(losses[0] - math.log(512)) < 1e-4  # fp32 rounding of a logsumexp of zeros, as logged
