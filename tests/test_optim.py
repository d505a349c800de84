import math

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.optim.clip import clip_grad_norm
from lmforge.optim.build import weight_decay_groups


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_matches_torch_over_many_steps(foreach):
    torch.manual_seed(0)
    ours_params = [torch.randn(17, 9, requires_grad=True), torch.randn(9, requires_grad=True),
                   torch.randn(4, 3, 2, requires_grad=True)]
    ref_params = [p.detach().clone().requires_grad_() for p in ours_params]
    groups = lambda ps: [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]
    ours = AdamW(groups(ours_params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=foreach)
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


def train_with(make_optimizer, initial: list[torch.Tensor], steps: int, skip=lambda step, index: False,
               start=None):
    """Step a fresh copy of `initial` under `make_optimizer(groups)` with the same seeded gradients
    (magnitudes 1e-2 to 1e2) and a changing lr every time; `skip` leaves a gradient out. Returns
    the parameters and the optimizer; `start`, such a pair, is continued instead (as a checkpoint
    would: the parameters, and the optimizer state through state_dict)."""
    params = [p.detach().clone().requires_grad_() for p in (start[0] if start else initial)]
    optimizer = make_optimizer([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}])
    first = 0
    if start is not None:
        state = start[1].state_dict()
        optimizer.load_state_dict(state)
        first = int(state["state"][0]["step"].item())
    generator = torch.Generator().manual_seed(0)
    for step in range(first + steps):
        grads = [torch.randn(p.shape, generator=generator).mul_(10.0 ** (step % 5 - 2)).to(p.dtype)
                 for p in params]
        if step < first:
            continue  # the same gradients as an uninterrupted run
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * (0.5 + 0.5 * math.cos(math.pi * step / 200))
        for index, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if skip(step, index) else g
        optimizer.step()
    return params, optimizer


def assert_same_run(a, b):
    """Parameters and every state tensor bit for bit, with the same names and dtypes."""
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    for x, y in zip(params_a, params_b):
        state_a, state_b = opt_a.state[x], opt_b.state[y]
        assert state_a.keys() == state_b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in state_a:
            assert state_a[key].dtype == state_b[key].dtype and state_a[key].device == state_b[key].device
            assert torch.equal(state_a[key], state_b[key]), key


def small_model_parameters(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(make_config("tiny").model).to(dtype)
    return [p.detach() for p in dict.fromkeys(model.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_foreach_equals_the_loop_and_torch_on_a_small_model(dtype):
    """200 steps on the tiny model's parameters. Our two paths agree bit for bit (on CPU: they run
    the same kernels in the same order), and both match torch.optim.AdamW. In bf16 only torch's
    per-parameter path is compared: its foreach path multiplies by bf16-rounded factors on CPU
    (see `_exact` in lmforge/optim/adamw.py), which changes the result by bf16 units, and no
    tolerance wide enough for that would still catch a wrong update."""
    initial = small_model_parameters(dtype)
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    loop = train_with(lambda groups: AdamW(groups, foreach=False, **hyper), initial, 200)
    foreach = train_with(lambda groups: AdamW(groups, foreach=True, **hyper), initial, 200)
    assert_same_run(loop, foreach)
    for torch_foreach in ([False, True] if dtype == torch.float32 else [False]):
        reference, _ = train_with(lambda groups: torch.optim.AdamW(groups, foreach=torch_foreach, **hyper),
                                  initial, 200)
        for ours, theirs in zip(foreach[0], reference):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_adamw_foreach_groups_dtypes_and_steps_a_parameter_that_missed_steps():
    """Mixed dtypes in one param group go to separate foreach lists; a parameter without a gradient
    on some steps falls behind in its step count, and its group then takes the loop."""
    torch.manual_seed(0)
    initial = [torch.randn(6, 5), torch.randn(7, 3, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.float64),
               torch.randn(2, 3), torch.randn(5), torch.randn(3, dtype=torch.bfloat16)]
    skip = lambda step, index: index == 0 and step % 7 == 3  # behind the other fp32 matrix from step 4 on
    runs = [train_with(lambda groups: AdamW(groups, foreach=foreach), initial, 30, skip) for foreach in (False, True)]
    assert_same_run(*runs)
    params, optimizer = runs[1]
    assert [optimizer.state[p]["step"].item() for p in params] == [26, 30, 30, 30, 30, 30]


def test_adamw_foreach_makes_no_per_parameter_call(monkeypatch):
    """With step counts in agreement (every parameter stepped each time), the default path never
    reaches the per-parameter update."""
    initial = small_model_parameters(torch.float32)
    train_with(lambda groups: AdamW(groups), initial, 2)  # state exists before the check below
    monkeypatch.setattr(AdamW, "_update_one", lambda *args: pytest.fail("per-parameter update"))
    params, optimizer = train_with(lambda groups: AdamW(groups), initial, 3)
    assert optimizer.foreach and all(optimizer.state[p]["step"].item() == 3 for p in params)


def test_a_loop_state_continues_on_the_foreach_path_bit_for_bit():
    """Checkpoints hold optimizer.state_dict(): one saved by either path resumes on the other."""
    initial = small_model_parameters(torch.float32)
    straight = train_with(lambda groups: AdamW(groups, foreach=False), initial, 20)
    first_half = train_with(lambda groups: AdamW(groups, foreach=False), initial, 10)
    resumed = train_with(lambda groups: AdamW(groups, foreach=True), initial, 10, start=first_half)
    assert_same_run(straight, resumed)


def test_lost_updates_are_counted_alike_on_both_paths():
    """bf16 weights with updates near their resolution: some round away (see the docstring)."""
    counts = []
    for foreach in (False, True):
        torch.manual_seed(0)
        params = [torch.randn(64, 32).bfloat16().requires_grad_(), torch.randn(32).bfloat16().requires_grad_()]
        optimizer = AdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                          lr=1e-3, count_lost_updates=True, foreach=foreach)
        steps = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
            steps.append((optimizer.lost_updates, optimizer.updated_elements))
        counts.append(steps)
    assert counts[0] == counts[1]
    assert all(0 < lost < updated == 64 * 32 + 32 for lost, updated in counts[1])


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
