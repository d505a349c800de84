"""Measure what autograd really keeps for backward: the ground truth for the activation formulas.

`saved_tensors_hooks` sees every tensor an operation saves for its backward. Several saved tensors
can share one storage (a view and its base, the same input saved by two ops), so each storage is
counted once, at its full size. Storages that belong to parameters are reported apart: they are
the weights themselves, already counted as parameter memory, not activations.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class SavedBytes:
    activations: int = 0  # bytes of distinct non-parameter storages saved for backward
    parameters: int = 0  # bytes of parameter storages saved for backward (not activations)
    by_dtype: dict[str, int] = field(default_factory=dict)  # activations split by dtype
    storages: int = 0  # number of distinct activation storages


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.device, storage.nbytes()


@contextmanager
def measure_saved_bytes(parameters=()):
    """Context manager yielding a SavedBytes filled in as the forward pass inside it runs.

        with measure_saved_bytes(model.parameters()) as saved:
            loss = model(x, y)
        saved.activations  # bytes autograd holds until backward
    """
    result = SavedBytes()
    parameter_keys = {_storage_key(p) for p in parameters}
    seen: set = set()
    keep_alive: list = []  # holds each seen tensor so its storage address cannot be reused meanwhile

    def pack(tensor: torch.Tensor):
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            key = _storage_key(tensor)
            if key not in seen:
                seen.add(key)
                keep_alive.append(tensor)
                nbytes = key[2]
                if key in parameter_keys:
                    result.parameters += nbytes
                else:
                    result.activations += nbytes
                    result.storages += 1
                    name = str(tensor.dtype).removeprefix("torch.")
                    result.by_dtype[name] = result.by_dtype.get(name, 0) + nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
