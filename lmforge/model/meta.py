"""The model without initialisation: its shapes for the accounting (accounting/shapes.py), a module
tree for setup on the meta device (train/setup.py), storage for weights about to be assigned
(runs/load.py, interop/)."""

import torch
from torch.overrides import TorchFunctionMode

from lmforge.config import ModelConfig
from lmforge.model.transformer import Transformer

_RANDOM_FILLS = {torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
                 torch.Tensor.normal_, torch.Tensor.uniform_}


class _SkipRandomFills(TorchFunctionMode):
    """Meta tensors (all this builds) hold no values, so random initialisation has nothing to
    do; and the meta kernel of normal_ is a Python reference that imports torch._dynamo on
    first use: 2-3 s on a busy 2-core machine, 30x the build itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig, device: str = "meta") -> Transformer:
    """lmforge's Transformer for `cfg` without initialisation: on the meta device shapes and no
    storage; on a real device uninitialised storage, for weights to be assigned (runs/load.py)."""
    with torch.device(device), _SkipRandomFills():
        return Transformer(cfg)
