"""AdaGrad (Duchi, Hazan & Singer 2011, "Adaptive Subgradient Methods for Online Learning and
Stochastic Optimization", the diagonal update of section 1.1, eq. 1 with diag(G_t)), as
torch.optim.Adagrad computes it (no learning-rate decay of its own: lmforge's schedule sets lr).

For each parameter theta with gradient g:

    g <- g + lambda * theta          L2 weight decay, added to the gradient
    s <- s + g^2                     the sum of every squared gradient so far (starts at 0)
    theta <- theta - lr * g / (sqrt(s) + eps)

Each element's rate falls as its gradients accumulate: large for rare features, small for
frequent ones. State: `sum` per parameter. A loop over parameters (see sgd.py for why).
"""

import torch

from lmforge.optim.per_parameter import PerParameter, l2_decayed


class Adagrad(PerParameter):
    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0):
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"invalid Adagrad hyper-parameters: lr={lr}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    def update(self, param: torch.Tensor, group: dict) -> None:
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        g = l2_decayed(param, decay)
        (s,) = self.zero_states(param, "sum")
        s.addcmul_(g, g, value=1.0)
        param.addcdiv_(g, s.sqrt().add_(eps), value=-lr)
