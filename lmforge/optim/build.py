"""The optimizer of `optim.name`, built over param groups: BUILDERS maps each name that
`lmforge train` trains (modes/, trained=True) to a function (cfg, policy, param_groups).

The param groups are `param_groups(cfg, model)`'s: weight_decay_groups for every optimizer but
Muon, which also needs to know its matrices (optim/muon.py, muon_param_groups). Each group carries
its own `weight_decay` (the config's for matrices and embeddings, 0 for gains and biases), which
overrides the optimizer's default. To add an optimizer: write its builder below, add it to
BUILDERS, mark its name trained in modes/ and give its states in
accounting/memory.py (tests/test_optimizers.py checks the three agree and that the plan's
state bytes are measured).
"""

from collections.abc import Callable

import torch

from lmforge.config import Config
from lmforge.modes import Policy
from lmforge.optim.adafactor import build_adafactor
from lmforge.optim.adagrad import Adagrad
from lmforge.optim.adam import Adam
from lmforge.optim.adamw import AdamW
from lmforge.optim.lion import Lion
from lmforge.optim.muon import build_muon, muon_param_groups
from lmforge.optim.rmsprop import RMSprop
from lmforge.optim.sgd import SGD


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave gains and biases alone (decaying a norm's gain toward
    zero only fights the normalisation). Tied tensors appear once; frozen ones not at all."""
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def param_groups(cfg: Config, model: torch.nn.Module) -> list[dict]:
    """The groups optim.name's optimizer is built over (the sharding engines turn them into groups of shards)."""
    groups_of = muon_param_groups if cfg.optim.name == "muon" else weight_decay_groups
    return groups_of(model, cfg.optim.weight_decay)


def _adam(cls):
    """AdamW's or Adam's builder: the config's betas and eps; lost updates counted where the policy loses them."""
    return lambda cfg, policy, groups: cls(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                           eps=cfg.optim.eps, count_lost_updates=policy.lossy_updates)


Builder = Callable[[Config, Policy, list[dict]], torch.optim.Optimizer]

# each a function (cfg, policy, param_groups); the plain ones take optim.lr and the settings they name
BUILDERS: dict[str, Builder] = {
    "adamw": _adam(AdamW),
    "adam": _adam(Adam),
    "sgd": lambda cfg, policy, groups: SGD(groups, lr=cfg.optim.lr),
    "sgd-momentum": lambda cfg, policy, groups: SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                                                    nesterov=cfg.optim.nesterov),
    "adagrad": lambda cfg, policy, groups: Adagrad(groups, lr=cfg.optim.lr, eps=cfg.optim.eps),
    "rmsprop": lambda cfg, policy, groups: RMSprop(groups, lr=cfg.optim.lr, alpha=cfg.optim.beta2, eps=cfg.optim.eps),
    "lion": lambda cfg, policy, groups: Lion(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2)),
    "adafactor": build_adafactor,
    "muon": build_muon,
    # add an optimizer here (and in modes/, accounting/memory.py)
}


def make_optimizer(cfg: Config, policy: Policy, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer of cfg.optim.name over `param_groups` (config validation refused any other name)."""
    return BUILDERS[cfg.optim.name](cfg, policy, param_groups)
