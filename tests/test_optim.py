import math

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.optim.clip import clip_grad_norm
from lmforge.train.trainer import weight_decay_groups


def test_adamw_matches_torch_over_many_steps():
    torch.manual_seed(0)
    ours_params = [torch.randn(17, 9, requires_grad=True), torch.randn(9, requires_grad=True),
                   torch.randn(4, 3, 2, requires_grad=True)]
    ref_params = [p.detach().clone().requires_grad_() for p in ours_params]
    groups = lambda ps: [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]
    ours = AdamW(groups(ours_params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW(groups(ref_params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for step in range(200):
        lr = 3e-3 * (0.5 + 0.5 * math.cos(math.pi * step / 200))  # changing lr, as the schedule does
        grads = [torch.randn_like(p) * (10 ** (step % 5 - 2)) for p in ours_params]  # varied magnitudes
        for opt in (ours, reference):
            for group in opt.param_groups:
                group["lr"] = lr
        for params in (ours_params, ref_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        ours.step()
        reference.step()
    for a, b in zip(ours_params, ref_params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # the state round-trips through state_dict like torch's
    assert ours.state_dict()["state"][0]["step"].item() == 200


def test_adamw_first_step_is_sign_of_gradient_times_lr():
    """Bias correction makes the first update lr * g / (|g| + eps) = lr * sign(g)."""
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.tensor([1.0, -2.0, 3e-3, -4e3, 5.0])
    AdamW([p], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(p.detach(), -0.1 * torch.sign(p.grad), atol=1e-6, rtol=0)


def test_adamw_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="invalid AdamW"):
        AdamW([torch.zeros(1, requires_grad=True)], betas=(0.9, 1.0))


def test_weight_decay_skips_gains_and_biases_and_counts_tied_once():
    model = Transformer(make_config("gpt2-124m", overrides=["model.n_layers=1", "model.vocab_size=300",
                                                            "model.d_model=32", "model.n_heads=2",
                                                            "model.max_seq_len=16"]).model)
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()


def test_clip_matches_torch():
    torch.manual_seed(0)
    params = [torch.randn(10, 4, requires_grad=True), torch.randn(3, requires_grad=True)]
    reference = [p.detach().clone().requires_grad_() for p in params]
    for p, r in zip(params, reference):
        p.grad = torch.randn_like(p) * 5
        r.grad = p.grad.clone()
    norm = clip_grad_norm(params, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    torch.testing.assert_close(norm, expected)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])) == pytest.approx(1.0, rel=1e-5)


def test_clip_zero_only_measures():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm([p], 0.0).item() == pytest.approx(5.0)
    assert p.grad.tolist() == [3.0, 4.0, 0.0]


def test_gradient_accumulation_equals_one_big_batch():
    """Float64, so that the comparison sees the algorithm and not fp32 summation order (Adam's
    first step divides each gradient by its own magnitude, which magnifies rounding noise)."""
    cfg = make_config("tiny").model
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (8, 33))
    updates = []
    for micro_batches in (1, 4):
        torch.manual_seed(1)
        model = Transformer(cfg).double()
        opt = AdamW(model.parameters(), lr=1e-2)
        for chunk in tokens.chunk(micro_batches):
            (model(chunk[:, :-1], chunk[:, 1:]) / micro_batches).backward()
        clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updates[0], updates[1], atol=1e-9, rtol=0)
