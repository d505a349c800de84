"""A checkpoint read back by parameter name (checkpoint/__init__.py): model weights into a model or
an engine of any world size, optimizer state, RNG states, or its tensors as they are stored."""

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from lmforge.common.errors import LmforgeError
from lmforge.model.lora import adapter_state_dict, has_lora
from lmforge.runs.checkpoint.tensors import (failure_reason, load_tensors, storage_aliases, stored_tensors,
                                             tied_names)


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} ({shown}{', ...' if len(names) > limit else ''})"


def load_model_weights(model: torch.nn.Module, path: Path, strict: bool = True) -> tuple[list[str], list[str]]:
    """Load the checkpoint's weights into `model` by parameter name (one process: generation,
    fine-tuning bases, tests); returns the names the model has and the checkpoint lacks, and those
    the checkpoint has and the model lacks. With `strict` (the default) either is an error that
    lists them; without, the rest is loaded. A shape that differs always stops. A local file read,
    never a collective, also under torchrun: rank 0 reads a fine-tuning base alone first
    (World.main_first), while the others wait for it."""
    # a model with LoRA adapters is checkpointed as its adapters alone (its base is loaded apart)
    expected = adapter_state_dict(model) if has_lora(model) else model.state_dict()
    tensors, missing, unexpected = _read_by_name(path, expected, strict, local=True)
    model.load_state_dict(tensors, strict=False)
    return missing, unexpected


def load_engine_weights(engine, path: Path) -> None:
    """Load the checkpoint's weights into the model of `engine` (any data-parallel strategy, any
    world size: every rank reads the full tensors and keeps its part); strict, by name."""
    expected = engine.model_state_dict()
    if has_lora(engine.model):  # the adapters alone (a pipeline stage its own, knowing every stage's names)
        adapters = {name: expected[name] for name in adapter_state_dict(engine.model)}
        tensors, _, _ = _read_by_name(path, adapters, strict=True, known=engine.model_names(), local=True)
        # the frozen base as the engine holds it, the adapters from the checkpoint: through the
        # engine, which keeps each rank's part (ZeRO's shards and master copies, FSDP's, tp slices)
        engine.load_model_state_dict({**expected, **tensors})
        return
    # a tied weight's second name: the same tensor in the state dict, or (FSDP2's full state dict
    # copies each name) the same parameter in the model
    aliases = {**storage_aliases(expected), **tied_names(engine.model)}
    tensors, _, _ = _read_by_name(path, expected, strict=True, aliases=aliases, known=engine.model_names())
    engine.load_model_state_dict({name: tensors[name] if name in tensors else tensors[aliases[name]]
                                  for name in expected})


def _read_by_name(path: Path, expected: dict[str, torch.Tensor], strict: bool, aliases: dict[str, str] | None = None,
                  known: set[str] | None = None, local: bool = False):
    """The checkpoint's model tensors that `expected` names (shapes checked), the names it lacks
    (a tied weight's second name does not count) and those it has beyond `known` (by default the
    expected names; a pipeline stage expects its own but knows every stage's)."""
    _refuse_old_format(path)
    stored = stored_tensors(path, "model")
    for name in (n for n in expected if n in stored):  # model order: the first layer named first
        shape = stored[name][0]
        if shape != tuple(expected[name].shape):
            raise LmforgeError(f"checkpoint {path} was saved from a model of a different shape: "
                               f"{name} is {shape} there, {tuple(expected[name].shape)} here")
    wanted = {name: spec for name, spec in stored.items() if name in expected}
    unexpected = sorted(stored.keys() - (expected.keys() if known is None else known))
    aliases = storage_aliases(expected) if aliases is None else aliases
    missing = [n for n in expected if n not in stored and aliases.get(n) not in wanted]
    if strict and unexpected:
        raise LmforgeError(f"checkpoint {path} holds {_listed(unexpected)} tensors this model does not have: "
                           f"it was saved from a different model")
    if strict and missing:
        raise LmforgeError(f"checkpoint {path} lacks {_listed(missing)} of this model's tensors: it was "
                           f"saved from a different model")
    return _load(path, "model", wanted, local), missing, unexpected


def read_tensors(path: Path, folder: str = "model") -> dict[str, torch.Tensor]:
    """Checkpoint `path`'s tensors of `folder` (model or optimizer) by name, in their stored dtype,
    on the CPU (this process's own read)."""
    _refuse_old_format(path)
    return _load(path, folder, stored_tensors(path, folder), local=True)


def _refuse_old_format(path: Path) -> None:
    if not (path / "model").is_dir() and (path / "model.safetensors").is_file():
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (safetensors files, before "
                           f"distributed checkpoints): this version cannot read it; train it again")


def _load(path: Path, folder: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
          local: bool = False) -> dict[str, torch.Tensor]:
    """The tensors `specs` names (name -> shape, dtype), read from checkpoint `path`'s `folder`
    (by this process alone with `local`, else by every rank together: tensors.load_tensors)."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    try:
        load_tensors(tensors, path / folder, local)
    except CheckpointException as err:
        raise LmforgeError(f"checkpoint {path} is corrupt: {folder} could not be read "
                           f"({failure_reason(err)})") from None
    return tensors


def load_optimizer_state(engine, path: Path, param_groups: list[dict]) -> None:
    """Restore the optimizer state saved by `save_checkpoint` into `engine` (lmforge/parallel/), by
    parameter name, so that its optimizer state equals the saved one (each rank keeps its part).
    The optimizer must cover the same names (listed otherwise). JSON turned tuples (AdamW's betas)
    into lists: they are tuples again where the freshly built optimizer holds a tuple."""
    live = engine.optimizer_state_dict()["param_groups"]
    saved_names = [name for group in param_groups for name in group["params"]]
    live_names = [name for group in live for name in group["params"]]
    if saved_names != live_names:
        only_saved = [n for n in saved_names if n not in set(live_names)]
        only_live = [n for n in live_names if n not in set(saved_names)]
        raise LmforgeError(f"checkpoint {path} has optimizer state for other parameters than this optimizer's"
                           + (f"; only in the checkpoint: {_listed(only_saved)}" if only_saved else "")
                           + (f"; only here: {_listed(only_live)}" if only_live else "")
                           + ("; the same names in another grouping" if not only_saved and not only_live else ""))
    param_groups = [{key: tuple(value) if isinstance(group.get(key), tuple) else value
                     for key, value in saved.items()}
                    for saved, group in zip(param_groups, engine.optimizer.param_groups)]
    state: dict[str, dict] = {}
    for key, value in _load(path, "optimizer", stored_tensors(path, "optimizer")).items():
        name, field = key.rsplit(".", 1)
        state.setdefault(name, {})[field] = value
    engine.load_optimizer_state_dict({"state": state, "param_groups": param_groups})


def load_rng_states(path: Path, device: torch.device = torch.device("cpu")) -> None:
    """Restore the generators of this process (every rank gets the states rank 0 saved)."""
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
