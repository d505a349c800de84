"""Stochastic gradient descent, with heavy-ball or Nesterov momentum, as torch.optim.SGD computes it
(dampening 0).

For each parameter theta with gradient g (Sutskever, Martens, Dahl & Hinton 2013, "On the importance
of initialization and momentum in deep learning", eq. 1-2 and 3-4, in PyTorch's form, with the
learning rate outside the buffer):

    g <- g + lambda * theta          L2 weight decay, added to the gradient
    b <- g                           at the first step
    b <- mu * b + g                  after it (momentum mu > 0)
    d = g + mu * b  (Nesterov)  |  b  (heavy ball)  |  g  (mu = 0: plain SGD)
    theta <- theta - lr * d

Nesterov's look-ahead (eq. 3-4) evaluates the gradient at theta + mu v; PyTorch's form, used here,
is the same algorithm rewritten in the current parameters (Bengio, Boulanger-Lewandowski & Pascanu
2013, section 3.5). State: `momentum_buffer` per parameter (none without momentum).

A loop over parameters only: two or three element-wise operations per tensor, and the models here
have tens of tensors; adamw.py has the foreach path for the default optimizer.
"""

import torch

from lmforge.optim.per_parameter import PerParameter, l2_decayed


class SGD(PerParameter):
    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0 or not 0.0 <= momentum < 1.0 or (nesterov and momentum == 0):
            raise ValueError(f"invalid SGD hyper-parameters: lr={lr}, momentum={momentum}, nesterov={nesterov}, "
                             f"weight_decay={weight_decay} (Nesterov needs momentum > 0)")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    def update(self, param: torch.Tensor, group: dict) -> None:
        lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
        d = l2_decayed(param, decay)
        if mu != 0:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = d.clone(memory_format=torch.preserve_format)
            else:
                state["momentum_buffer"].mul_(mu).add_(d)
            buf = state["momentum_buffer"]
            d = d.add(buf, alpha=mu) if group["nesterov"] else buf
        param.add_(d, alpha=-lr)
