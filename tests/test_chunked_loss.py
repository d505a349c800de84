"""The chunked head + loss (wrap.py) against the plain loss, and its memory in the plan.

Tolerances: in fp32 the two compute the same sums in another grouping (chunks of rows, dW summed
chunk by chunk), so they agree to a few fp32 roundings (rel 1e-5, where fp32's eps is 1.2e-7 and
an error such as a missing 1/N or a wrong target column is O(1)). Under bf16 the logits and dz are
rounded to bf16 on both paths (rel 2^-9 each), so the two differ by about that; the test holds the
chunked path to the plain one's own error against a float64 reference instead, which a wrong
implementation cannot meet either.
"""

import pytest
import torch
import torch.nn.functional as F

from lmforge.accounting.memory import logits_bytes
from lmforge.accounting.activations import activation_breakdown
from lmforge.config import make_config
from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import IGNORE_INDEX, Transformer, cross_entropy_loss
from lmforge.modes import POLICIES, get_policy
from lmforge.precision.policy import autocast, prepare_model
from lmforge.wrap import ChunkedHeadLoss, _ChunkedCrossEntropy, apply_chunked_loss, apply_recompute
from lmforge.accounting.measure import measure_saved_bytes

N, D, V = 150, 32, 700


def _grads(loss_fn, h0, w0, dtype):
    h, w = h0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_()
    loss = loss_fn(h, w)
    (3.0 * loss).backward()  # an incoming gradient other than 1 (a loss scale, 1/grad_accum)
    return [t.detach().double() for t in (loss, h.grad, w.grad)]


def _relative_errors(got, reference):
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, reference)]


@pytest.mark.parametrize("chunk", [1, 37, N, 1000])
@pytest.mark.parametrize("bf16_autocast", [False, True])
def test_loss_and_gradients_equal_the_plain_loss(chunk, bf16_autocast):
    torch.manual_seed(0)
    h0, w0, y = torch.randn(N, D), torch.randn(V, D) * 0.3, torch.randint(0, V, (N,))
    reference = _grads(lambda h, w: cross_entropy_loss((h @ w.t())[None], y[None]), h0, w0, torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        plain = _grads(lambda h, w: cross_entropy_loss(F.linear(h, w)[None], y[None]), h0, w0, torch.float32)
        chunked = _grads(lambda h, w: _ChunkedCrossEntropy.apply(h, w, y, chunk), h0, w0, torch.float32)
    assert chunked[1].dtype == plain[1].dtype and chunked[0].shape == ()
    if not bf16_autocast:
        assert max(_relative_errors(chunked, plain)) < 1e-5
    else:
        for error, plain_error in zip(_relative_errors(chunked, reference), _relative_errors(plain, reference)):
            assert error <= 1.25 * plain_error + 1e-6


@pytest.mark.parametrize("chunk", [1, 37, 1000])
def test_targets_left_out_are_left_out_as_the_plain_loss_does(chunk):
    # fine-tuning examples: prompt tokens and padding are IGNORE_INDEX; the mean is over the rest
    torch.manual_seed(0)
    h0, w0, y = torch.randn(N, D), torch.randn(V, D) * 0.3, torch.randint(0, V, (N,))
    y[torch.rand(N) < 0.6] = IGNORE_INDEX
    plain = _grads(lambda h, w: cross_entropy_loss(F.linear(h, w)[None], y[None]), h0, w0, torch.float32)
    chunked = _grads(lambda h, w: _ChunkedCrossEntropy.apply(h, w, y, chunk), h0, w0, torch.float32)
    assert max(_relative_errors(chunked, plain)) < 1e-5
    assert not chunked[1][y == IGNORE_INDEX].any()  # a left-out token sends no gradient back


@pytest.mark.parametrize("precision", list(POLICIES))
def test_a_model_trains_the_same_with_the_chunked_loss(precision):
    cfg = make_config("tiny", overrides=["model.vocab_size=600"]).model
    tokens, targets = torch.randint(0, 600, (2, 3, 40))
    results = []
    for chunk in (0, 50):
        torch.manual_seed(0)
        model = apply_chunked_loss(prepare_model(Transformer(cfg), get_policy(precision)), chunk)
        with autocast(get_policy(precision), torch.device("cpu")):
            loss = model(tokens, targets)
            with torch.no_grad():  # evaluation: the same loss, no gradients computed
                assert model(tokens, targets).item() == loss.item()
        loss.backward()
        results.append((loss.item(), [p.grad.double() for p in model.parameters()]))
    (plain_loss, plain_grads), (chunked_loss, chunked_grads) = results
    assert isinstance(model.loss, ChunkedHeadLoss)
    # fp32: regrouped sums; below fp32: the 16-bit roundings of logits and dz (see the docstring)
    tolerance = 1e-5 if precision == "fp32" else 3e-2
    assert chunked_loss == pytest.approx(plain_loss, rel=tolerance)
    for a, b in zip(chunked_grads, plain_grads):
        assert ((a - b).norm() / b.norm()).item() < tolerance


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("precision", list(POLICIES))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_plan_counts_what_the_chunked_loss_saves(family, precision, recompute):
    overrides = [f"model.family={family}"] + (["model.n_kv_heads=null"] if family == "gpt" else [])
    cfg = make_config("tiny", overrides=overrides).model
    model = apply_recompute(prepare_model(Transformer(cfg), get_policy(precision)), recompute)
    apply_chunked_loss(model, 64)
    # tokens and targets in storages of their own (the targets are not saved: their bytes must not
    # ride along in the tokens' storage)
    tokens, targets = torch.randint(0, cfg.vocab_size, (3, 48)), torch.randint(0, cfg.vocab_size, (3, 48))
    with autocast(get_policy(precision), torch.device("cpu")), measure_saved_bytes(model.parameters()) as saved:
        loss = model(tokens, targets)
    loss.backward()
    measured = saved.activations
    predicted = activation_breakdown(cfg, 3, 48, get_policy(precision), "sdpa", recompute, loss_chunk_tokens=64)
    predicted.pop("recomputed_layer", None)
    assert abs(sum(predicted.values()) - measured) <= 8  # the loss's scalar, as in test_memory


def test_the_logits_the_plan_counts_shrink_to_one_chunk():
    cfg = make_config("gpt2-124m").model
    bf16, fp32 = get_policy("bf16-mixed"), get_policy("fp32")
    whole = logits_bytes(cfg, 8, 1024, bf16)
    assert whole == 8 * 1024 * 50257 * (2 + 4)
    assert logits_bytes(cfg, 8, 1024, bf16, loss_chunk_tokens=1024) == whole / 8
    assert logits_bytes(cfg, 1, 100, fp32, loss_chunk_tokens=1024) == logits_bytes(cfg, 1, 100, fp32)


def test_a_head_it_cannot_chunk_is_refused():
    cfg = make_config("tiny", overrides=["model.family=gpt", "model.n_kv_heads=null"]).model
    model = Transformer(cfg)
    model.lm_head = torch.nn.Linear(cfg.d_model, cfg.vocab_size)  # with a bias
    with pytest.raises(LmforgeError, match="train.loss_chunk_tokens"):
        apply_chunked_loss(model, 16)
