"""The optimizer of `optim.name`, built over param groups: BUILDERS maps each name that
`lmforge train` trains (modes/optimizers.py, trained=True) to a function (cfg, policy, param_groups).

The param groups come from the trainer (train/setup.py, weight_decay_groups): each carries its own
`weight_decay` (the config's for matrices and embeddings, 0 for gains and biases), which overrides
the optimizer's default. To add an optimizer: write its builder below, add it to BUILDERS, mark its
name trained in modes/optimizers.py and give its states in accounting/optimizers.py
(tests/test_optimizers.py checks the three agree and that the plan's state bytes are measured).
"""

from collections.abc import Callable

import torch

from lmforge.config import Config
from lmforge.modes.precision import Policy
from lmforge.optim.adagrad import Adagrad
from lmforge.optim.adam import Adam
from lmforge.optim.adamw import AdamW
from lmforge.optim.lion import Lion
from lmforge.optim.rmsprop import RMSprop
from lmforge.optim.sgd import SGD


def adamw(cfg: Config, policy: Policy, param_groups: list[dict]) -> AdamW:
    o = cfg.optim
    return AdamW(param_groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, count_lost_updates=policy.lossy_updates)


def adam(cfg: Config, policy: Policy, param_groups: list[dict]) -> Adam:
    o = cfg.optim
    return Adam(param_groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, count_lost_updates=policy.lossy_updates)


def sgd(cfg: Config, policy: Policy, param_groups: list[dict]) -> SGD:
    return SGD(param_groups, lr=cfg.optim.lr)


def sgd_momentum(cfg: Config, policy: Policy, param_groups: list[dict]) -> SGD:
    return SGD(param_groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)


def adagrad(cfg: Config, policy: Policy, param_groups: list[dict]) -> Adagrad:
    return Adagrad(param_groups, lr=cfg.optim.lr, eps=cfg.optim.eps)


def rmsprop(cfg: Config, policy: Policy, param_groups: list[dict]) -> RMSprop:
    return RMSprop(param_groups, lr=cfg.optim.lr, alpha=cfg.optim.beta2, eps=cfg.optim.eps)


def lion(cfg: Config, policy: Policy, param_groups: list[dict]) -> Lion:
    return Lion(param_groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2))


Builder = Callable[[Config, Policy, list[dict]], torch.optim.Optimizer]

BUILDERS: dict[str, Builder] = {
    "adamw": adamw,
    "adam": adam,
    "sgd": sgd,
    "sgd-momentum": sgd_momentum,
    "adagrad": adagrad,
    "rmsprop": rmsprop,
    "lion": lion,
    # add an optimizer here (and in modes/optimizers.py, accounting/optimizers.py)
}


def make_optimizer(cfg: Config, policy: Policy, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer of cfg.optim.name over `param_groups` (config validation refused any other name)."""
    return BUILDERS[cfg.optim.name](cfg, policy, param_groups)
