"""lmforge's optimizers (lmforge/optim/) against their PyTorch counterparts, Lion against a
transcription of its paper's Algorithm 2 and the lion-pytorch package; one list of names shared
by config validation, the plan and the trainer; the plan's state bytes measured; resume by name.

Tolerance: none. Each of ours runs the same element-wise operations in the same order as its
reference (torch's single-tensor path, foreach=False; lion-pytorch's update_fn), so after 200
steps on the same gradients every parameter is bit-identical (torch.equal). A term left out or
changed (a momentum, a decay, an eps, a bias correction) moves every element: the perturbation
test below shows that the comparison sees a single hyper-parameter changed in its 4th digit.
"""

import math

import lion_pytorch
import pytest
import torch

from lmforge.accounting.measure import model_state_bytes_measured
from lmforge.accounting.memory import OPTIMIZERS, optimizer_state_bytes
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.modes import OPTIMIZER_MODES, TRAINED_OPTIMIZERS, get_policy
from lmforge.optim.adagrad import Adagrad
from lmforge.optim.adam import Adam
from lmforge.optim.build import BUILDERS
from lmforge.optim.lion import Lion
from lmforge.optim.rmsprop import RMSprop
from lmforge.optim.sgd import SGD
from lmforge.train.setup import build_model, build_optimizer
from tests.test_checkpoint import assert_same_state_dict, parameters, quiet_trainer, run_until_killed

STEPS, LR = 200, 3e-3


def initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(17, 9, generator=g), torch.randn(9, generator=g), torch.randn(4, 3, 2, generator=g)]


def groups(params: list[torch.Tensor]) -> list[dict]:
    """Two groups as the trainer makes them: decay on some tensors, none on the others."""
    return [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]


def run(make_optimizer, steps: int = STEPS) -> list[torch.Tensor]:
    """The parameters after `steps` steps of make_optimizer(param_groups) on one fixed gradient
    sequence of varied magnitudes (1e-2 to 1e2), with a changing lr as the schedule sets it."""
    params = [p.clone().requires_grad_() for p in initial()]
    optimizer = make_optimizer(groups(params))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LR * (0.5 + 0.5 * math.cos(math.pi * step / steps))
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** (step % 5 - 2)
        optimizer.step()
    return [p.detach() for p in params]


def assert_bit_identical(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for a, b in zip(ours, reference):
        assert torch.equal(a, b), (a - b).abs().max().item()


def lion_algorithm_2(param_groups: list[dict]):
    """Chen et al. 2023, Algorithm 2, line by line (a torch.optim.Optimizer only to hold the state)."""
    class PaperLion(torch.optim.Optimizer):
        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                eta, lam = group["lr"], group["weight_decay"]
                beta1, beta2 = 0.9, 0.99
                for theta in group["params"]:
                    g = theta.grad
                    m = self.state[theta].setdefault("m", torch.zeros_like(theta))
                    c = beta1 * m + (1 - beta1) * g                     # c_t <- b1 m_{t-1} + (1 - b1) g_t
                    theta.copy_(theta * (1 - eta * lam) - eta * c.sign())   # theta_t <- theta - eta (sign(c) + lam theta)
                    m.copy_(beta2 * m + (1 - beta2) * g)                # m_t <- b2 m_{t-1} + (1 - b2) g_t
    return PaperLion(param_groups, {})


# (ours, reference) builders over the same param groups: each of ours against its reference
SAME_ARITHMETIC = {
    "sgd": (lambda gs: SGD(gs, lr=LR), lambda gs: torch.optim.SGD(gs, lr=LR, foreach=False)),
    "sgd-momentum": (lambda gs: SGD(gs, lr=LR, momentum=0.9),
                     lambda gs: torch.optim.SGD(gs, lr=LR, momentum=0.9, foreach=False)),
    "sgd-nesterov": (lambda gs: SGD(gs, lr=LR, momentum=0.9, nesterov=True),
                     lambda gs: torch.optim.SGD(gs, lr=LR, momentum=0.9, nesterov=True, foreach=False)),
    "adagrad": (lambda gs: Adagrad(gs, lr=LR, eps=1e-10), lambda gs: torch.optim.Adagrad(gs, lr=LR, foreach=False)),
    "rmsprop": (lambda gs: RMSprop(gs, lr=LR, alpha=0.99),
                lambda gs: torch.optim.RMSprop(gs, lr=LR, alpha=0.99, foreach=False)),
    "rmsprop-momentum-centered": (
        lambda gs: RMSprop(gs, lr=LR, alpha=0.95, momentum=0.9, centered=True),
        lambda gs: torch.optim.RMSprop(gs, lr=LR, alpha=0.95, momentum=0.9, centered=True, foreach=False)),
    "rmsprop-momentum": (lambda gs: RMSprop(gs, lr=LR, momentum=0.5),
                         lambda gs: torch.optim.RMSprop(gs, lr=LR, momentum=0.5, foreach=False)),
    "adam-loop": (lambda gs: Adam(gs, lr=LR, betas=(0.9, 0.95), foreach=False),
                  lambda gs: torch.optim.Adam(gs, lr=LR, betas=(0.9, 0.95), foreach=False)),
    "adam-foreach": (lambda gs: Adam(gs, lr=LR, betas=(0.9, 0.95), foreach=True),
                     lambda gs: torch.optim.Adam(gs, lr=LR, betas=(0.9, 0.95), foreach=False)),
    "lion-paper": (lambda gs: Lion(gs, lr=LR), lion_algorithm_2),
    "lion-pytorch": (lambda gs: Lion(gs, lr=LR), lambda gs: lion_pytorch.Lion(gs, lr=LR)),
}


@pytest.mark.parametrize("name", SAME_ARITHMETIC)
def test_each_optimizer_is_bit_identical_to_its_reference_over_200_steps(name):
    ours, reference = SAME_ARITHMETIC[name]
    assert_bit_identical(run(ours), run(reference))


# one hyper-parameter of ours off in its 4th digit (or a switch flipped), the reference as above;
# AdaGrad's eps (1e-10) is below the last bit of sqrt(sum) >= 1e-2 here, so it is raised to 1e-6
# (1e-4 of the smallest sqrt(sum)) to show that the eps term is there at all; Lion steps by a
# sign, which a beta off in its 4th digit flipped nowhere in these 200 steps (measured), so its
# beta2 is 0.98 instead of 0.99
PERTURBED = {
    "sgd-momentum": lambda gs: SGD(gs, lr=LR, momentum=0.9001),
    "sgd-nesterov": lambda gs: SGD(gs, lr=LR, momentum=0.9),
    "adagrad": lambda gs: Adagrad(gs, lr=LR, eps=1e-6),
    "rmsprop-momentum-centered": lambda gs: RMSprop(gs, lr=LR, alpha=0.95, momentum=0.9, centered=False),
    "adam-loop": lambda gs: Adam(gs, lr=LR, betas=(0.9, 0.9501), foreach=False),
    "lion-paper": lambda gs: Lion(gs, lr=LR, betas=(0.9, 0.98)),
}


@pytest.mark.parametrize("name", PERTURBED)
def test_the_comparison_sees_one_term_changed(name):
    with pytest.raises(AssertionError):
        assert_bit_identical(run(PERTURBED[name]), run(SAME_ARITHMETIC[name][1]))


def test_adam_decays_in_the_gradient_and_leaves_the_stored_gradient_alone():
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.zeros(3)
    Adam([{"params": [p], "weight_decay": 0.5}], lr=0.1).step()
    assert torch.equal(p.grad, torch.zeros(3))  # decay went into a copy
    # first Adam step on g = 0.5 * theta: lr * sign(g) (bias-corrected), not AdamW's (1 - lr lambda)
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9), rtol=0, atol=1e-6)


def test_the_names_agree_between_modes_plan_and_trainer():
    assert list(OPTIMIZERS) == list(OPTIMIZER_MODES)
    assert set(BUILDERS) == set(TRAINED_OPTIMIZERS)
    # the plan's names of before this list kept working for `lmforge plan --optimizer`
    assert {"adamw", "adamw-8bit", "adafactor", "lion", "sgd-momentum", "sgd"} <= set(OPTIMIZERS)


@pytest.mark.parametrize("overrides, message", [
    (["optim.name=lino"], "optim.name must be one of adamw, adam, sgd, sgd-momentum, adagrad, rmsprop, lion, "
                          "adamw-8bit, adafactor, muon, got 'lino' (did you mean 'lion'?)"),
    (["optim.name=adamw-8bit"], "optim.name=adamw-8bit is costed by the plan but not trained: it needs "
                                "bitsandbytes' 8-bit kernels, which lmforge does not implement; use adamw"),
    (["optim.nesterov=true"], "optim.nesterov=true applies to optim.name=sgd-momentum with optim.momentum > 0, "
                              "got optim.name=adamw, optim.momentum=0.9"),
    (["optim.name=sgd-momentum", "optim.momentum=1"], "optim.momentum must be in [0, 1), got 1.0"),
])
def test_bad_optimizer_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(LmforgeError) as err:
        make_config("tiny", overrides=overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
@pytest.mark.parametrize("name", TRAINED_OPTIMIZERS)
def test_measured_state_bytes_equal_the_plans(name, precision):
    cfg = make_config("tiny", overrides=[f"optim.name={name}", f"train.precision={precision}"])
    policy = get_policy(precision)
    torch.manual_seed(0)
    model = build_model(cfg, policy)
    optimizer = build_optimizer(cfg, policy, model)
    assert type(optimizer) is type(BUILDERS[name](cfg, policy, [{"params": [torch.zeros(1)]}]))
    model(*torch.randint(0, cfg.model.vocab_size, (2, 2, 16))).backward()
    optimizer.step()
    measured = model_state_bytes_measured(model, optimizer)["optimizer_states"]
    assert measured == optimizer_state_bytes(cfg.model, name, policy)
    assert (measured > 0) == (name != "sgd")


def test_an_interrupted_lion_run_resumes_bit_identical(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config("optim.name=lion", "optim.lr=1e-3", max_steps=8, checkpoint_interval=4)
    straight = quiet_trainer(cfg, tmp_path / "straight")
    straight.run()
    run_until_killed(cfg, tmp_path / "resumed", kill_at_step=6, monkeypatch=monkeypatch)
    resumed = quiet_trainer(cfg, tmp_path / "resumed", resume=True)
    assert resumed.step == 4 and isinstance(resumed.optimizer, Lion)
    resumed.run()
    expected, actual = parameters(straight), parameters(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert_same_state_dict(straight.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    assert {k for s in resumed.optimizer.state.values() for k in s} == {"exp_avg"}
