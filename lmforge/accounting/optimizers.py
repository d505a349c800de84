"""Optimizer state bytes per parameter, by optimizer: what `lmforge plan --optimizer` chooses.

EleutherAI's "Transformer Math 101" (Anthony, Biderman and Schoelkopf 2023, "Optimizer States")
counts, per parameter in mixed precision, an fp32 copy of the weights (4 bytes) plus the states:
AdamW 4 + 8 = 12 bytes (momentum and variance, fp32), 8-bit AdamW 4 + 2 = 6 (bitsandbytes),
SGD with momentum 4 + 4 = 8. lmforge's mixed-precision policies keep fp32 parameters that are
their own master copy (modes/), so the states alone are counted here and the copy
is the policy's parameter bytes. The others:

- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", algorithm 2) keeps only
  the momentum: one state, as SGD with momentum.
- Adam keeps AdamW's two; AdaGrad its sum of squared gradients, RMSProp its moving average of them
  (as trained: no momentum, not centered; optim/rmsprop.py): one each.
- Adafactor (Shazeer and Stern 2018, section 3) without momentum (beta1 = 0, the paper's and
  Hugging Face's default) factors the second moment of an n x m matrix into n row and m column
  averages: 4(n + m) bytes instead of 4nm; a vector keeps its full second moment.
- 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", section 2):
  each state in one byte, with one fp32 absolute maximum per block of 2048 values; bitsandbytes
  keeps the states of tensors under 4096 elements (`min_8bit_size`) in fp32.

Factored and 8-bit states depend on each parameter's shape, read from the model (shapes.py).
"""

import math
from dataclasses import dataclass

from lmforge.accounting.shapes import model_shapes
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes import OPTIMIZER_MODES, POLICIES, Policy

QUANTIZATION_BLOCK = 2048  # values per fp32 absmax in 8-bit states (Dettmers et al. 2022)
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 states (bitsandbytes' default)


@dataclass(frozen=True)
class Optimizer:
    states: int  # state tensors of each parameter's shape (Adafactor: 0, its states are factored)
    eight_bit: bool = False  # states quantised to one byte, block-wise
    factored: bool = False  # Adafactor's row and column second moments
    hidden_matrix_states: int | None = None  # Muon: states of a block's 2-D weights (the rest: `states`)


_STATES: dict[str, Optimizer] = {
    "adamw": Optimizer(states=2),
    "adam": Optimizer(states=2),
    "adamw-8bit": Optimizer(states=2, eight_bit=True),
    "adafactor": Optimizer(states=0, factored=True),
    "lion": Optimizer(states=1),
    "sgd-momentum": Optimizer(states=1),
    "sgd": Optimizer(states=0),
    "adagrad": Optimizer(states=1),
    "rmsprop": Optimizer(states=1),
    # Muon's momentum for the blocks' matrices, AdamW's two moments for the rest (optim/muon.py)
    "muon": Optimizer(states=2, hidden_matrix_states=1),
}
# keyed by modes/'s names, in its order: a name added there without its states here
# fails at import, not in the middle of a plan
OPTIMIZERS: dict[str, Optimizer] = {name: _STATES[name] for name in OPTIMIZER_MODES}


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str = "adamw", policy: Policy = POLICIES["fp32"],
                          parameter_shapes: tuple | None = None, hidden_matrices: int | None = None) -> float:
    """Bytes of every optimizer state of the whole model (unsharded), or of the parameters of
    `parameter_shapes` (a pipeline stage's: accounting/pipeline.py, with `hidden_matrices`, the
    elements of its blocks' 2-D weights, for Muon); `policy` gives the bytes of a full-precision
    state element (fp32, or bf16 under bf16-pure)."""
    opt = lookup(OPTIMIZERS, optimizer, "optimizer")
    element = policy.bytes.optimizer_state
    if opt.hidden_matrix_states is not None:
        if parameter_shapes is None:
            shapes = model_shapes(cfg)
            # a block's 2-D parameters are its linear layers' weights (optim/muon.py's is_hidden_matrix)
            parameters, hidden_matrices = shapes.parameters, shapes.block_matmul_weights
        elif hidden_matrices is None:  # shapes alone do not say which are the blocks' matrices
            raise ValueError(f"{optimizer}'s states of a pipeline stage need its hidden_matrices "
                             f"(accounting/pipeline.py's StageParameters)")
        else:
            parameters = sum(math.prod(shape) for shape in parameter_shapes)
        return element * (opt.states * parameters - (opt.states - opt.hidden_matrix_states) * hidden_matrices)
    total = 0.0
    for shape in parameter_shapes if parameter_shapes is not None else model_shapes(cfg).parameter_shapes:
        n = math.prod(shape)
        if opt.factored:
            # Hugging Face's layout: row averages over the last dim, column averages over the second to last
            total += element * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else n)
        elif opt.eight_bit and n >= MIN_8BIT_SIZE:
            total += opt.states * (n + 4 * math.ceil(n / QUANTIZATION_BLOCK))
        else:
            total += opt.states * n * element
    return total
