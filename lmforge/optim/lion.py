"""Lion, EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms", Algorithm 2, decoupled weight decay included).

For each parameter theta with gradient g:

    c = beta1 * m + (1 - beta1) * g                  interpolate momentum and gradient
    theta <- theta - lr * (sign(c) + lambda * theta)  every element moves by exactly lr (plus decay)
    m <- beta2 * m + (1 - beta2) * g                 then the momentum, with a slower beta2

Written as the paper's pseudocode reads: the decay first (theta * (1 - lr lambda), which is
theta - lr lambda theta), then the sign step. The update has the same size in every element, so
the paper (section 3.2) takes lr 3-10x smaller than AdamW's and lambda 3-10x larger, keeping
lr * lambda about the same; its default betas are (0.9, 0.99). One state, `exp_avg` (the momentum,
as the lion-pytorch package names it): half of AdamW's. A loop over parameters (see sgd.py).
"""

import torch

from lmforge.optim.per_parameter import PerParameter


class Lion(PerParameter):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid Lion hyper-parameters: lr={lr}, betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def update(self, param: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
        g = param.grad
        (m,) = self.zero_states(param, "exp_avg")
        c = m.mul(beta1).add_(g, alpha=1.0 - beta1)
        param.mul_(1.0 - lr * decay)
        param.add_(c.sign_(), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)
