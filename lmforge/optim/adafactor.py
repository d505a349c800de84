"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
algorithms 4 and 5, without momentum), in the form of torch.optim.Adafactor.

For a parameter X of n x m (any leading dims are batch dims) with gradient G at step t:

    beta2_t = 1 - t^decay                       (decay = -0.8: section 7.2, "increasing decay")
    rho_t   = min(lr, 1 / sqrt(t))              relative step size (section 8)
    alpha_t = max(eps2, RMS(X)) rho_t           the step is relative to the parameter's scale
    X <- X - lr lambda X                        decoupled weight decay (torch's; 0 by default)
    R <- beta2_t R + (1 - beta2_t) mean_cols(G^2)        n row averages       (section 3)
    C <- beta2_t C + (1 - beta2_t) mean_rows(G^2)        m column averages
    V  = R C / mean(R)                          the rank-1 estimate of the second moment (eq. 4:
                                                with sums, R C / 1^T R; with means, the same)
    U  = G / sqrt(max(V, eps1^2))
    X <- X - alpha_t U / max(1, RMS(U) / d)     update clipping (section 5, d = 1)

A vector keeps its full second moment V <- beta2_t V + (1 - beta2_t) G^2. So a matrix keeps n + m
numbers instead of nm: the state layout is torch's (and Hugging Face's), `row_var` of shape
(..., n, 1) and `col_var` of shape (..., 1, m), which accounting/memory.py costs. eps1 None
is the parameter dtype's machine epsilon. The squared means are computed as squared norms divided
by the length, as torch computes them, so that no G^2 temporary the size of G is made and the two
agree bit for bit (tested).
"""

import torch

from lmforge.optim.per_parameter import PerParameter


class Adafactor(PerParameter):
    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0):
        if lr < 0 or beta2_decay > 0 or d < 1 or weight_decay < 0 or eps[1] < 0 or (eps[0] or 0) < 0:
            raise ValueError(f"invalid Adafactor hyper-parameters: lr={lr}, beta2_decay={beta2_decay}, "
                             f"eps={eps}, d={d}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            if param.dim() > 1:
                state["row_var"] = param.new_zeros((*param.shape[:-1], 1))
                state["col_var"] = param.new_zeros((*param.shape[:-2], 1, param.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def update(self, param: torch.Tensor, group: dict) -> None:
        lr, decay, d = group["lr"], group["weight_decay"], group["d"]
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        grad = param.grad
        state = self._state(param)
        state["step"] += 1
        t = state["step"].item()
        one_minus_beta2 = t ** group["beta2_decay"]
        rho = min(lr, 1 / t**0.5)
        alpha = max(eps2, param.norm(2).item() / param.numel() ** 0.5) * rho  # before the decay, as torch

        if decay != 0:
            param.mul_(1 - lr * decay)
        if grad.dim() > 1:
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            state["row_var"].lerp_(row_mean, one_minus_beta2)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            state["col_var"].lerp_(col_mean, one_minus_beta2)
            row_var = state["row_var"]
            variance = row_var @ state["col_var"]
            variance.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            state["variance"].lerp_(grad * grad, one_minus_beta2)
            variance = state["variance"].clone()  # the state itself is not clamped
        update = variance.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
        clip = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * d))
        param.add_(update, alpha=-alpha / clip)


def build_adafactor(cfg, policy, param_groups: list[dict]) -> Adafactor:
    """Adafactor over `param_groups` (optim/build.py's weight-decay groups: decay on matrices and
    embeddings only): optim.lr caps the relative step size, optim.weight_decay is the decoupled
    decay (times optim.lr, as torch's), optim.adafactor_* the rest. `policy` is unused: the state
    has the parameters' dtype, and lost updates are counted by AdamW alone."""
    o = cfg.optim
    return Adafactor(param_groups, lr=o.lr, beta2_decay=o.adafactor_beta2_decay, d=o.adafactor_clip_threshold,
                     weight_decay=o.weight_decay)
