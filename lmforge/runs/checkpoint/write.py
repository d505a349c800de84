"""`save_checkpoint`: a run's state written as one checkpoint folder (checkpoint/__init__.py), staged,
sealed with its manifest and renamed into place, the oldest beyond `keep` pruned."""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from lmforge.common.errors import LmforgeError
from lmforge.model.lora import adapter_state_dict, has_lora
from lmforge.parallel.world import World
from lmforge.runs.checkpoint.find import CHECKPOINT_DIR, FORMAT, file_sha256, kept_checkpoint, list_checkpoints
from lmforge.runs.checkpoint.tensors import failure_reason, save_tensors, storage_aliases, tied_names
from lmforge.common.folders import fsync_dir, move_into_place, staging_path


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the model of `engine` (lmforge/parallel/: any strategy, full
    tensors on every rank): its tensors by parameter name, a tied tensor under its first name only;
    of a model with LoRA adapters, the adapters alone (state.json names the frozen base)."""
    state = engine.model_state_dict()
    if has_lora(engine.model):
        # through the engine, like every other state: ZeRO-3 frees the adapters' storage between
        # steps, FSDP2 holds DTensor shards, tensor parallelism slices; the engine gathers them whole
        return {name: state[name].contiguous() for name in adapter_state_dict(engine.model)}
    aliases = {**storage_aliases(state), **tied_names(engine.model)}  # gathered, a tied matrix is two tensors
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def optimizer_tensors(engine) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's state of `engine` as flat tensors named `<parameter name>.<state key>`, and
    its param groups with parameter names for "params" (JSON-ready)."""
    state = engine.optimizer_state_dict()
    tensors = {f"{name}.{key}": value.detach()
               for name, per_param in state["state"].items() for key, value in per_param.items()}
    return tensors, state["param_groups"]


def non_finite_tensor(model_state: dict[str, torch.Tensor], optimizer_state: dict[str, torch.Tensor]) -> str | None:
    """The name of the first model or optimizer state tensor holding inf or NaN, or None.

    One max-of-|x| reduction per tensor (inf and NaN propagate through it) and one sync for all."""
    named = [(name, t) for name, t in model_state.items() if t.is_floating_point()]
    named += [(f"optimizer state {key.rsplit('.', 1)[1]} of {key.rsplit('.', 1)[0]}", t)
              for key, t in optimizer_state.items() if t.is_floating_point()]
    if not named:
        return None
    peaks = torch.stack([torch.linalg.vector_norm(t.detach(), float("inf")).float().cpu() for _, t in named])
    finite = torch.isfinite(peaks).tolist()
    return next((name for (name, _), ok in zip(named, finite) if not ok), None)


def save_checkpoint(run_dir: Path, step: int, engine, state: dict, extra_files: dict[str, bytes], keep: int,
                    world: World = World()) -> Path:
    """Write the checkpoint for `step` under run_dir/checkpoints; keep the newest `keep`. Every
    rank calls it (the tensors are written by all; `engine`'s full state by name is gathered by all
    first, lmforge/parallel/); rank 0 alone touches the rest of the folder.

    `extra_files` are written as given (config.yaml, tokenizer.json from the trainer's memory,
    not copied from the run folder, where a damaged file would be sealed into every checkpoint).
    A model or optimizer state holding inf or NaN is never saved; a save that fails for lack of
    space (or any OSError, on any rank) leaves no partial folder and the previous checkpoints
    untouched."""
    root = run_dir / CHECKPOINT_DIR
    final = root / f"step_{step:07d}"
    model_state = model_tensors(engine)
    optimizer_state, param_groups = optimizer_tensors(engine)
    bad = non_finite_tensor(model_state, optimizer_state)
    world.agree(LmforgeError(f"step {step} left inf/NaN in {bad}, so it was not saved; "
                             + kept_checkpoint(run_dir, "lower optim.lr or raise optim.warmup_steps"))
                if bad is not None else None)
    partial = staging_path(final)
    error = None
    try:
        if world.is_main:
            root.mkdir(parents=True, exist_ok=True)
            partial.mkdir()
        world.barrier()  # the folder exists before any rank writes into it
        parameters = engine.total_over_stages(sum(t.numel() for t in model_state.values()), model_state)
        _write_checkpoint(partial, model_state, optimizer_state,
                          {**state, "format": FORMAT, "step": step, "world_size": world.world_size,
                           "parameters": parameters, "param_groups": param_groups}, extra_files, world)
    except (OSError, CheckpointException) as err:
        error = err
    error = world.first_error(error)
    if error is not None:
        if world.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        message = (f"checkpoint {final} could not be written ({failure_reason(error)}); its partial folder is "
                   f"removed and " + kept_checkpoint(run_dir, "make room"))
        raise world.raised(LmforgeError(message)) from None
    if world.is_main:
        seal(partial)
        move_into_place(partial, final)  # the same step may be saved again (the last step after a resume)
        for old in list_checkpoints(run_dir)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    world.barrier()  # every rank returns with the checkpoint in place
    return final


def _write_checkpoint(partial: Path, model_state: dict, optimizer_state: dict, state: dict,
                      extra_files: dict[str, bytes], world: World) -> None:
    """Every rank's part of the tensors; rank 0 the RNG states, state.json and `extra_files`."""
    save_tensors(model_state, partial / "model")
    save_tensors(optimizer_state, partial / "optimizer")
    if not world.is_main:
        return
    # every rank draws the same random numbers (same seed, same shapes): rank 0's states stand for all
    rng = {"cpu": torch.get_rng_state()}
    device = world.device
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    save_file(rng, str(partial / "rng.safetensors"))
    _write_state(partial, state, extra_files)


def _write_state(path: Path, state: dict, extra_files: dict[str, bytes]) -> None:
    """state.json, and the files given as bytes (config.yaml, tokenizer.json)."""
    (path / "state.json").write_text(json.dumps(state, indent=2))
    for name, content in extra_files.items():
        (path / name).write_bytes(content)


def write_weights_checkpoint(path: Path, tensors: dict[str, torch.Tensor], state: dict,
                             extra_files: dict[str, bytes]) -> None:
    """A sealed checkpoint folder `path` of model weights alone, written by one process (inside a
    staged folder): no optimizer or RNG state, a model to start from rather than a run to resume."""
    path.mkdir(parents=True)
    save_tensors(tensors, path / "model")
    _write_state(path, {"format": FORMAT, **state}, extra_files)
    seal(path)


def seal(partial: Path) -> None:
    """Sync every file and write the manifest (names relative to the checkpoint folder), last."""
    manifest = {}
    for file in sorted(p for p in partial.rglob("*") if p.is_file()):  # subfolders included, in a fixed order
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        manifest[file.relative_to(partial).as_posix()] = {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
    with open(partial / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    for folder in [*(p for p in partial.iterdir() if p.is_dir()), partial]:
        fsync_dir(folder)
