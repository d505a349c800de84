"""Measure what autograd really keeps for backward: the ground truth for the activation formulas.

`saved_tensors_hooks` sees every tensor an operation saves for its backward. Several saved tensors
can share one storage (a view and its base, the same input saved by two ops), so each storage is
counted once, at its full size. Storages that belong to parameters are reported apart: they are
the weights themselves, already counted as parameter memory, not activations. ZeRO-3 and FSDP2
gather a block's weights just before it runs (parallel/zero.py, fsdp.py) and free them after:
given a function that returns the parameters (`model.parameters`), the parameters are read again
when a tensor is saved that matches none, so the gathered weights count as parameters too.
"""

import resource
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class SavedBytes:
    activations: int = 0  # bytes of distinct non-parameter storages saved for backward
    parameters: int = 0  # bytes of parameter storages saved for backward (not activations)
    by_dtype: dict[str, int] = field(default_factory=dict)  # activations split by dtype


def _storage_key(tensor: torch.Tensor):
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP2's sharded parameters): its local shard's storage
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.device, storage.nbytes()


@contextmanager
def measure_saved_bytes(parameters=()):
    """Context manager yielding a SavedBytes filled in as the forward pass inside it runs.
    `parameters`: the parameters, or a function returning them as they are at each save.

        with measure_saved_bytes(model.parameters) as saved:
            loss = model(x, y)
        saved.activations  # bytes autograd holds until backward
    """
    result = SavedBytes()
    current = parameters if callable(parameters) else (lambda listed=list(parameters): listed)
    parameter_keys = {_storage_key(p) for p in current()}
    seen: set = set()
    keep_alive: list = []  # holds each seen tensor so its storage address cannot be reused meanwhile

    def pack(tensor: torch.Tensor):
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            key = _storage_key(tensor)
            if key not in seen:
                seen.add(key)
                keep_alive.append(tensor)
                nbytes = key[2]
                if key not in parameter_keys and callable(parameters):  # a block's weights, gathered since
                    parameter_keys.update(_storage_key(p) for p in current())
                if key in parameter_keys:
                    result.parameters += nbytes
                else:
                    result.activations += nbytes
                    name = str(tensor.dtype).removeprefix("torch.")
                    result.by_dtype[name] = result.by_dtype.get(name, 0) + nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result


def unique_storages_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer counted once; None skipped)."""
    seen = {}
    for t in tensors:
        if t is not None and hasattr(t, "to_local"):  # a DTensor: this rank's part
            t = t.to_local()
        if t is not None and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes_measured(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's per-parameter state tensors (scalar step counters left out: a few
    bytes per tensor, not per parameter)."""
    if optimizer is None:
        return 0
    return unique_storages_bytes(t for state in optimizer.state.values() for t in state.values()
                                 if isinstance(t, torch.Tensor) and t.ndim > 0)


def model_state_bytes_measured(model: torch.nn.Module,
                               optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of the parameters, their gradients (those that exist) and the optimizer's
    per-parameter state tensors, read off the live tensors (shared parameters once)."""
    params = list(dict.fromkeys(model.parameters()))
    return {"parameters": unique_storages_bytes(params),
            "gradients": unique_storages_bytes(p.grad for p in params),
            "optimizer_states": optimizer_state_bytes_measured(optimizer)}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocated tensors on CUDA, the process's resident set on CPU (which also
    holds the Python runtime and libraries: an upper bound on what training needs)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
