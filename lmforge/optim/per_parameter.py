"""The loop the optimizers written one parameter at a time share (SGD, AdaGrad, RMSProp, Lion,
Adafactor): `step` evaluates the closure, as torch.optim's do, then calls `update(param, group)` for
every parameter that has a gradient. A subclass writes only its update, the paper's equations.
AdamW (and Adam, Muon on top of it) has its own step: its foreach path works on lists.
"""

import torch


def evaluate_closure(closure):
    """torch.optim's contract: `step(closure)` re-evaluates the loss (with gradients) and returns it."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PerParameter(torch.optim.Optimizer):
    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.update(param, group)
        return loss

    def update(self, param: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    def zero_states(self, param: torch.Tensor, *names: str) -> list[torch.Tensor]:
        """`param`'s state tensors `names`, each created as zeros of its shape when first asked for."""
        state = self.state[param]
        for name in names:
            if name not in state:
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return [state[name] for name in names]


def l2_decayed(param: torch.Tensor, decay: float) -> torch.Tensor:
    """The gradient with L2 weight decay added, g + lambda theta (a new tensor: .grad stays as backward wrote it)."""
    return param.grad.add(param, alpha=decay) if decay != 0 else param.grad
