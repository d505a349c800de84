"""RMSProp (Hinton, Srivastava & Swersky 2012, "Neural Networks for Machine Learning", lecture 6e),
with the momentum and centered variants of Graves 2013 ("Generating Sequences With Recurrent Neural
Networks", eq. 38-41), as torch.optim.RMSprop computes them.

For each parameter theta with gradient g:

    g <- g + lambda * theta                   L2 weight decay, added to the gradient
    v <- alpha * v + (1 - alpha) * g^2        moving average of the squared gradient
    centered:  a <- alpha * a + (1 - alpha) * g;  r = sqrt(v - a^2) + eps   (an estimate of the std)
    else:      r = sqrt(v) + eps
    momentum mu > 0:  b <- mu * b + g / r;  theta <- theta - lr * b
    else:             theta <- theta - lr * g / r

State per parameter: `square_avg`, plus `grad_avg` (centered) and `momentum_buffer` (mu > 0).
`lmforge train` builds it plain (mu = 0, not centered; alpha = optim.beta2): one state, as the plan
costs it. A loop over parameters (see sgd.py for why).
"""

import torch

from lmforge.optim.per_parameter import PerParameter, l2_decayed


class RMSprop(PerParameter):
    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not 0.0 <= alpha < 1.0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid RMSprop hyper-parameters: lr={lr}, alpha={alpha}, eps={eps}, "
                             f"weight_decay={weight_decay}, momentum={momentum}")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered))

    def update(self, param: torch.Tensor, group: dict) -> None:
        lr, alpha, eps, decay, mu = group["lr"], group["alpha"], group["eps"], group["weight_decay"], group["momentum"]
        g = l2_decayed(param, decay)
        (v,) = self.zero_states(param, "square_avg")
        v.mul_(alpha).addcmul_(g, g, value=1.0 - alpha)
        if group["centered"]:
            (a,) = self.zero_states(param, "grad_avg")
            a.lerp_(g, 1.0 - alpha)  # alpha a + (1 - alpha) g
            r = v.addcmul(a, a, value=-1.0).sqrt_().add_(eps)
        else:
            r = v.sqrt().add_(eps)
        if mu > 0:
            (b,) = self.zero_states(param, "momentum_buffer")
            b.mul_(mu).addcdiv_(g, r)
            param.add_(b, alpha=-lr)
        else:
            param.addcdiv_(g, r, value=-lr)
