"""One torch.distributed.checkpoint folder (a checkpoint's model/ or optimizer/): tensors by name,
each stored whole in the folder's logical view, written by every rank together or by one process."""

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lmforge.common.errors import LmforgeError, os_error_message
from lmforge.model.names import canonical_name


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """One torch.distributed.checkpoint folder; collective when a process group is up (every rank
    calls it and writes its part), a plain write in one process."""
    with warnings.catch_warnings():  # dcp says at every call that it assumes one process: it is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=not dist.is_initialized())


def load_tensors(tensors: dict[str, torch.Tensor], folder: Path, local: bool = False) -> None:
    """Fill `tensors` in place from a folder `save_tensors` wrote (any number of ranks wrote it):
    collective when a process group is up (every rank restoring an engine calls it together), or
    with `local` this process's own file read (a fine-tuning base, which rank 0 reads before the
    others; generation)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(folder), no_dist=local or not dist.is_initialized())


def stored_tensors(path: Path, folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in checkpoint `path`'s `folder`, from its metadata."""
    try:
        metadata = dcp.FileSystemReader(str(path / folder)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a missing, cut or garbled .metadata (a pickle)
        raise LmforgeError(f"checkpoint {path} is corrupt: {folder}/.metadata unreadable "
                           f"({type(err).__name__})") from None
    return {name: (tuple(entry.size), entry.properties.dtype) for name, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size")}


def storage_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name of the same tensor (a tied weight's second name) in a state dict."""
    first, aliases = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """name -> the first name of the same parameter (a tied weight), in checkpoint names: where the
    engine gathers each name into its own tensor (tensor parallelism, FSDP2), storage_aliases misses it."""
    first, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[canonical_name(name)] = first[id(p)]
        else:
            first[id(p)] = canonical_name(name)
    return aliases


def failure_reason(error: BaseException) -> str:
    """What went wrong in a save or load, in one line (dcp wraps each rank's exception)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    cause = error
    while cause is not None and not isinstance(cause, OSError):  # torch.save's writer hides the OSError
        cause = cause.__cause__ or cause.__context__
    error = cause or error
    if isinstance(error, OSError):
        return os_error_message(error)
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__
