"""AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2).

For each parameter theta with gradient g at step t (t = 1, 2, ...):

    theta <- theta - lr * lambda * theta            decoupled decay: not part of the gradient
    m <- beta1 * m + (1 - beta1) * g                first moment   (Kingma & Ba 2015, Alg. 1)
    v <- beta2 * v + (1 - beta2) * g^2              second moment
    m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)       bias correction
    theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)

The decay multiplies by the scheduled lr, as torch.optim.AdamW does, so that the two agree.

With `count_lost_updates=True` the optimizer also counts, per step, the parameter elements whose
update was not zero but which did not change: the update was smaller than half a unit in the last
place of the stored value and rounded away. In fp32 this is rare; with parameters stored in bf16
(8 significant bits) it is the known cost of dropping the fp32 master copy (Micikevicius et al.
2018, section 3.1). The count costs a copy of each parameter per step, hence opt-in.
"""

import math

import torch


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, count_lost_updates: bool = False):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.count_lost_updates = count_lost_updates
        self.lost_updates = 0  # of the last step: elements whose non-zero update rounded to nothing
        self.updated_elements = 0  # of the last step: elements that received an update

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lost = updated = 0
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                before = param.clone() if self.count_lost_updates else None

                param.mul_(1.0 - lr * decay)
                m.lerp_(grad, 1.0 - beta1)  # m + (1 - beta1)(g - m) = beta1 m + (1 - beta1) g
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                bias_correction1 = 1.0 - beta1**t
                bias_correction2 = 1.0 - beta2**t
                denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                param.addcdiv_(m, denom, value=-lr / bias_correction1)
                if before is not None:
                    intended = (m != 0) | ((before != 0) & (lr * decay != 0))
                    lost += int((intended & (param == before)).sum())
                    updated += int(intended.sum())
        if self.count_lost_updates:
            self.lost_updates, self.updated_elements = lost, updated
        return loss
