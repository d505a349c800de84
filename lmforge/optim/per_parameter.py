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
