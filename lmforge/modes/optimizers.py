"""The optimizers by name: the one list that `optim.name` (config/validate.py), the plan's
`--optimizer` (accounting/memory.py, keyed by these names) and the trainer's builders
(optim/build.py, BUILDERS) share.

A module without torch, so that config validation and `lmforge plan` can name them without
importing the training code. `trained` says whether optim/build.py builds it: a name the plan can
cost but training cannot run is refused by config validation with `why`.

To add an optimizer: an entry here (trained=True), its state count in accounting/memory.py,
its builder in optim/build.py (tests/test_optimizers.py checks that the three agree).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerMode:
    name: str
    trained: bool  # optim/build.py builds it for `lmforge train`
    description: str
    why: str = ""  # not trained: what to use instead (one line for the user)


OPTIMIZER_MODES: dict[str, OptimizerMode] = {mode.name: mode for mode in (
    OptimizerMode("adamw", True, "Adam with decoupled weight decay (Loshchilov & Hutter 2019): the default"),
    OptimizerMode("adam", True, "Adam (Kingma & Ba 2015), weight decay as L2 in the gradient (torch.optim.Adam)"),
    OptimizerMode("sgd", True, "plain stochastic gradient descent, no state"),
    OptimizerMode("sgd-momentum", True, "SGD with heavy-ball or Nesterov momentum (optim.momentum, optim.nesterov)"),
    OptimizerMode("adagrad", True, "AdaGrad (Duchi et al. 2011): per-element rates from the summed squared gradients"),
    OptimizerMode("rmsprop", True, "RMSProp (Hinton 2012): per-element rates from a moving average of g^2"),
    OptimizerMode("lion", True, "Lion (Chen et al. 2023): the sign of interpolated momentum, one state"),
    OptimizerMode("adamw-8bit", False, "AdamW with block-wise 8-bit states (Dettmers et al. 2022)",
                  why="it needs bitsandbytes' 8-bit kernels, which lmforge does not implement; use adamw"),
    OptimizerMode("adafactor", True, "Adafactor (Shazeer & Stern 2018): factored second moment (ddp or one process)"),
    OptimizerMode("muon", True, "Muon (Jordan et al. 2024): orthogonalised momentum for the blocks' matrices, "
                                "AdamW for the rest (optim.muon_*)"),
)}
TRAINED_OPTIMIZERS = tuple(name for name, mode in OPTIMIZER_MODES.items() if mode.trained)
