"""AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2).

For each parameter theta with gradient g at step t (t = 1, 2, ...):

    theta <- theta - lr * lambda * theta            decoupled decay: not part of the gradient
    m <- beta1 * m + (1 - beta1) * g                first moment   (Kingma & Ba 2015, Alg. 1)
    v <- beta2 * v + (1 - beta2) * g^2              second moment
    m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)       bias correction
    theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)

The decay multiplies by the scheduled lr, as torch.optim.AdamW does, so that the two agree.

Two paths compute the same thing with the same operations in the same order:
- the loop (`foreach=False`), one parameter at a time: the reference, to read;
- the foreach path (the default), each operation applied to a whole list of tensors at once with
  `torch._foreach_*` (fused kernels over many tensors on CUDA, one C++ loop on CPU), so a step
  costs a fixed number of Python calls however many parameters there are. Each param group is
  split into lists by device and dtype, as the ops require. The bias corrections are host
  scalars, one per list: its parameters are stepped together, so their step counts agree (one
  read of them all per list checks it); a list where they do not (a parameter that had no
  gradient at some step) is stepped by the loop instead.
On CPU the two paths are bit-identical (tested); the state is the same either way: per parameter
`step` (a float32 CPU scalar tensor, as torch's), `exp_avg` and `exp_avg_sq` (the parameter's dtype).
The price of the foreach path is memory: it holds the denominators sqrt(v_hat) + eps of a whole
list at once, one parameter-sized temporary at the step's peak where the loop holds one tensor's.

With `count_lost_updates=True` the optimizer also counts, per step, the parameter elements whose
update was not zero but which did not change: the update was smaller than half a unit in the last
place of the stored value and rounded away. In fp32 this is rare; with parameters stored in bf16
(8 significant bits) it is the known cost of dropping the fp32 master copy (Micikevicius et al.
2018, section 3.1). The count costs a copy of each parameter and a few operations per parameter
per step on either path, hence opt-in.
"""

import math
from collections import defaultdict

import torch

from lmforge.optim.per_parameter import evaluate_closure


def _exact(factor: float) -> torch.Tensor:
    """`factor` for torch._foreach_mul_, as a 0-dim float64 CPU tensor rather than a Python float:
    on CPU (torch 2.13) the in-place foreach multiply by a Python float first rounds the float to
    the tensors' dtype (bf16: 0.95 -> 0.9492), which Tensor.mul_ does not; with a tensor factor
    both compute alike. On CUDA a CPU scalar tensor goes to the same fused kernel as a float."""
    return torch.tensor(factor, dtype=torch.float64)


class AdamW(torch.optim.Optimizer):
    # the weight decay: decoupled, theta <- theta - lr lambda theta (this class); False: L2 added to
    # the gradient, g <- g + lambda theta, before the moments see it (Adam, adam.py)
    decoupled_decay = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, count_lost_updates: bool = False,
                 foreach: bool | None = None):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid {type(self).__name__} hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # An attribute, not a param-group entry: the groups are saved in checkpoints, and which
        # path computes the step is not part of the state (both give the same numbers).
        # None means foreach: the ops exist for dense tensors on every device torch runs on.
        self.foreach = True if foreach is None else foreach
        self.count_lost_updates = count_lost_updates
        self.lost_updates = 0  # of the last step: elements whose non-zero update rounded to nothing
        self.updated_elements = 0  # of the last step: elements that received an update

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        counts = [0, 0]  # lost, updated: tensors once counting has begun, read once at the end
        for group in self.param_groups:
            self._group_step(group, counts)
        if self.count_lost_updates:
            self.lost_updates, self.updated_elements = int(counts[0]), int(counts[1])
        return loss

    def _group_step(self, group: dict, counts: list) -> None:
        """One param group's AdamW step, by the loop or the foreach path (Muon, optim/muon.py,
        overrides it for its matrices and calls it for the parameters it leaves to AdamW)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not self.foreach:
            for param in params:
                self._update_one(param, group, counts)
            return
        by_device_and_dtype = defaultdict(list)
        for param in params:
            by_device_and_dtype[param.device, param.dtype].append(param)
        for same_kind in by_device_and_dtype.values():
            self._update_many(same_kind, group, counts)

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update_one(self, param: torch.Tensor, group: dict, counts: list) -> None:
        """The reference: one parameter's step, read top to bottom beside the docstring."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = param.grad
        state = self._state(param)
        state["step"] += 1
        t = state["step"].item()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        before = param.clone() if self.count_lost_updates else None

        if self.decoupled_decay:
            param.mul_(1.0 - lr * decay)
        elif decay != 0:
            grad = grad.add(param, alpha=decay)
        m.lerp_(grad, 1.0 - beta1)  # m + (1 - beta1)(g - m) = beta1 m + (1 - beta1) g
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**t
        bias_correction2 = 1.0 - beta2**t
        denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(m, denom, value=-lr / bias_correction1)
        if before is not None:
            self._count(before, param, m, self.decoupled_decay and lr * decay != 0, counts)

    def _update_many(self, params: list[torch.Tensor], group: dict, counts: list) -> None:
        """The same step for parameters of one device and dtype, each operation over the whole list."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        step_counts = torch.stack(steps).unique()
        if step_counts.numel() > 1:  # rare: some parameter missed steps; the loop handles any mix
            for param in params:
                self._update_one(param, group, counts)
            return
        # the tensor overload adds one wrapped scalar, instead of wrapping 1 once per step tensor
        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        t = step_counts.item() + 1
        grads = [p.grad for p in params]
        ms = [s["exp_avg"] for s in states]
        vs = [s["exp_avg_sq"] for s in states]
        before = [p.clone() for p in params] if self.count_lost_updates else None

        if decay != 0 and self.decoupled_decay:  # the loop multiplies by exactly 1.0 here, which changes nothing
            torch._foreach_mul_(params, _exact(1.0 - lr * decay))
        elif decay != 0:
            grads = torch._foreach_add(grads, params, alpha=decay)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, _exact(beta2))
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**t
        bias_correction2 = 1.0 - beta2**t
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_div_(denoms, math.sqrt(bias_correction2))
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, ms, denoms, value=-lr / bias_correction1)
        if before is not None:
            for old, param, m in zip(before, params, ms):
                self._count(old, param, m, self.decoupled_decay and lr * decay != 0, counts)

    @staticmethod
    def _count(before: torch.Tensor, param: torch.Tensor, m: torch.Tensor, decaying: bool, counts: list) -> None:
        """Add to `counts` the elements meant to move (Adam step or decay non-zero) and those of
        them that did not; tensors, so that nothing waits on the device until the step's end."""
        intended = (m != 0) | ((before != 0) & decaying)
        counts[0] = counts[0] + (intended & (param == before)).sum()
        counts[1] = counts[1] + intended.sum()


def counts_lost_updates(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` counts lost updates (lmforge's AdamW asked to); any other counts nothing."""
    return isinstance(optimizer, AdamW) and optimizer.count_lost_updates
