"""Checkpoints: everything needed to continue a run bit for bit, written atomically, in one format
for every number of processes.

A checkpoint is a folder runs/<name>/checkpoints/step_NNNNNNN/ holding
    model/                  weights by parameter name (tied tensors stored once)    } torch.distributed.checkpoint
    optimizer/              optimizer state by parameter name: `<name>.exp_avg`, ... } folders: .metadata + a
                                                                                      __<rank>_0.distcp per rank
    rng.safetensors         random generator states (CPU, and CUDA where used; every rank runs the same)
    state.json              step, data-loader position, optimizer hyper-parameters, metrics so far,
                            the number of ranks and the per-rank batch it was written with
    config.yaml, tokenizer.json   as the trainer holds them in memory
    manifest.json           size and sha256 of every file above, written last
It is written to a hidden '.partial' folder (every rank writes its part with `dcp.save`, rank 0 the
rest), synced to disk, and after a barrier rank 0 writes the manifest and renames the folder into
place: a kill at any moment leaves the previous checkpoints whole, and a folder named step_NNNNNNN is
always complete. A model or optimizer state holding inf or NaN is refused before anything is
written, and a save that fails (a full disk, on any rank) removes its '.partial' and names the
checkpoint that is kept. Resuming takes the newest checkpoint whose files match their manifest,
reporting any newer one that does not (a disk error, a bad copy) instead of failing outright.

State is keyed by parameter name, as torch.distributed.checkpoint keys it (`get_model_state_dict`,
`get_optimizer_state_dict`; wrapper segments such as recomputation's are left out of the names),
not by position, and each tensor is stored whole in the checkpoint's logical view: a run saved by
N processes loads on M (one included: `dcp` needs no process group), a model with parameters
added (adapters) or removed can load what matches, and a parameter that moved in the optimizer's
order still gets its own state. Loading into a model whose names differ is an explicit choice
(`strict=False`) and lists the names.
"""

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from lmforge.common.errors import LmforgeError, os_error_message
from lmforge.parallel.world import World
from lmforge.model.names import canonical_name
from lmforge.model.lora import adapter_state_dict, has_lora

CHECKPOINT_DIR = "checkpoints"
# 3: torch.distributed.checkpoint folders. 2 (safetensors files, by parameter name) and 1 (no
# "format" in state.json; optimizer state by position) are refused with one line.
FORMAT = 3
STEP_PATTERN = re.compile(r"^step_(\d+)$")
TENSOR_FOLDERS = ("model", "optimizer")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_synced(path: Path, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the model of `engine` (lmforge/parallel/: any strategy, full
    tensors on every rank): its tensors by parameter name, a tied tensor under its first name only;
    of a model with LoRA adapters, the adapters alone (state.json names the frozen base)."""
    if has_lora(engine.model):
        return {name: t.contiguous() for name, t in adapter_state_dict(engine.model).items()}
    tensors, seen = {}, set()
    for name, tensor in engine.model_state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor
    return tensors


def optimizer_tensors(engine) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's state of `engine` as flat tensors named `<parameter name>.<state key>`, and
    its param groups with parameter names for "params" (JSON-ready)."""
    state = engine.optimizer_state_dict()
    tensors = {f"{name}.{key}": value.detach()
               for name, per_param in state["state"].items() for key, value in per_param.items()}
    return tensors, state["param_groups"]


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """One torch.distributed.checkpoint folder; collective when a process group is up (every rank
    calls it and writes its part), a plain write in one process."""
    with warnings.catch_warnings():  # dcp says at every call that it assumes one process: it is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=not dist.is_initialized())


def load_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill `tensors` in place from a folder `save_tensors` wrote (any number of ranks wrote it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(folder), no_dist=not dist.is_initialized())


def stored_tensors(path: Path, folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in checkpoint `path`'s `folder`, from its metadata."""
    try:
        metadata = dcp.FileSystemReader(str(path / folder)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a missing, cut or garbled .metadata (a pickle)
        raise LmforgeError(f"checkpoint {path} is corrupt: {folder}/.metadata unreadable ({type(err).__name__})") from None
    return {name: (tuple(entry.size), entry.properties.dtype) for name, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size")}


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
    partial = root / f".{final.name}.partial"
    error = None
    try:
        if world.is_main:
            root.mkdir(parents=True, exist_ok=True)
            remove_partials(run_dir)  # from a save that was killed half way
            partial.mkdir()
        world.barrier()  # the folder exists before any rank writes into it
        _write_checkpoint(partial, model_state, optimizer_state, param_groups, state, step, extra_files, world,
                          parameters=engine.total_over_stages(sum(t.numel() for t in model_state.values()), model_state))
    except (OSError, CheckpointException) as err:
        error = err
    error = world.first_error(error)
    if error is not None:
        if world.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise world.raised(LmforgeError(f"checkpoint {final} could not be written ({_reason(error)}); its partial "
                                        f"folder is removed and " + kept_checkpoint(run_dir, "make room"))) from None
    if world.is_main:
        seal(partial)
        if final.exists():  # the same step saved again (e.g. the last step after a resume)
            stale = root / f".{final.name}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(partial, final)
            shutil.rmtree(stale)
        else:
            os.rename(partial, final)
        _fsync_dir(root)
        for old in list_checkpoints(run_dir)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    world.barrier()  # every rank returns with the checkpoint in place
    return final


def _reason(error: BaseException) -> str:
    """What went wrong in a save, in one line (dcp wraps each rank's exception)."""
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


def _write_checkpoint(partial: Path, model_state: dict, optimizer_state: dict, param_groups: list[dict], state: dict,
                      step: int, extra_files: dict[str, bytes], world: World, parameters: int) -> None:
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
    (partial / "state.json").write_text(json.dumps({**state, "format": FORMAT, "step": step, "world_size":
                                                    world.world_size, "parameters": parameters,
                                                    "param_groups": param_groups}, indent=2))
    for name, content in extra_files.items():
        (partial / name).write_bytes(content)


def _files(folder: Path) -> list[Path]:
    """Every file under `folder`, subfolders included, in a fixed order."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def seal(partial: Path) -> None:
    """Sync every file and write the manifest (names relative to the checkpoint folder), last."""
    manifest = {}
    for file in _files(partial):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        manifest[file.relative_to(partial).as_posix()] = {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
    _write_json_synced(partial / "manifest.json", manifest)
    for folder in [*(p for p in partial.iterdir() if p.is_dir()), partial]:
        _fsync_dir(folder)


def remove_partials(run_dir: Path) -> None:
    """Remove the staging folders of saves that were killed or failed half way."""
    root = run_dir / CHECKPOINT_DIR
    if root.is_dir():
        for leftover in [*root.glob(".step_*.partial"), *root.glob(".step_*.stale")]:
            shutil.rmtree(leftover, ignore_errors=True)


def kept_checkpoint(run_dir: Path, advice: str) -> str:
    """The end of the message of a run stopped by a bad or failed step: which checkpoint is
    good, then `advice` (what to change)."""
    found = list_checkpoints(run_dir)
    if not found:
        return f"there is no checkpoint yet: {advice}, and start again in a new run folder"
    return (f"the last good checkpoint is kept: {found[-1]}; {advice}, and continue with lmforge train "
            f"--resume {run_dir}. An update that grew huge without turning into inf/NaN cannot be told "
            f"apart afterwards: if that checkpoint's loss looks wrong, delete it to resume from an "
            f"earlier one with a lower optim.lr")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_PATTERN.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))


def find_checkpoint(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> Path:
    """The newest checkpoint of the run that passes `verify_checkpoint`; newer corrupt ones are
    reported through `warn` and skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise LmforgeError(f"run folder {run_dir} does not exist")
    found = list_checkpoints(run_dir)
    if not found:
        raise LmforgeError(f"{run_dir} has no checkpoint: it was stopped before its first save "
                           f"(train.checkpoint_interval); delete the folder and start the run again")
    problems = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
            return path
        except LmforgeError as err:
            problems.append(str(err))
            if warn is not None:
                warn(f"skipping {err}")
    raise LmforgeError(problems[0] if len(problems) == 1 else f"{problems[0]} (and no earlier checkpoint is intact)")


def verify_checkpoint(path: Path) -> None:
    """Check every file against the manifest; a corrupt or incomplete checkpoint stops here."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise LmforgeError(f"checkpoint {path} is corrupt: manifest.json unreadable") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise LmforgeError(f"checkpoint {path} is incomplete: {name} is missing")
        if file.stat().st_size != expected["bytes"] or file_sha256(file) != expected["sha256"]:
            raise LmforgeError(f"checkpoint {path} is corrupt: {name} does not match its checksum; "
                               f"resume from an earlier checkpoint or start a new run")


def check_format(path: Path, state: dict) -> None:
    if state.get("format") == 2:
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (safetensors files, before "
                           f"distributed checkpoints): this version cannot resume it; start a new run")
    if state.get("format") != FORMAT:
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (optimizer state by position, "
                           f"not by parameter name): this version cannot resume it; start a new run")


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} ({shown}{', ...' if len(names) > limit else ''})"


def load_model_weights(model: torch.nn.Module, path: Path, strict: bool = True) -> tuple[list[str], list[str]]:
    """Load the checkpoint's weights into `model` by parameter name (one process: generation,
    fine-tuning bases, tests); returns the names the model has and the checkpoint lacks, and those
    the checkpoint has and the model lacks. With `strict` (the default) either is an error that
    lists them; without, the rest is loaded. A shape that differs always stops."""
    # a model with LoRA adapters is checkpointed as its adapters alone (its base is loaded apart)
    expected = adapter_state_dict(model) if has_lora(model) else model.state_dict()
    tensors, missing, unexpected = _read_by_name(path, expected, strict)
    model.load_state_dict(tensors, strict=False)
    return missing, unexpected


def load_engine_weights(engine, path: Path) -> None:
    """Load the checkpoint's weights into the model of `engine` (any data-parallel strategy, any
    world size: every rank reads the full tensors and keeps its part); strict, by name."""
    if has_lora(engine.model):  # the adapters alone
        load_model_weights(engine.model, path)
        return
    expected = engine.model_state_dict()
    # a tied weight's second name: the same tensor in the state dict, or (FSDP2's full state dict
    # copies each name) the same parameter in the model
    aliases = {**_storage_aliases(expected), **_tied_names(engine.model)}
    tensors, _, _ = _read_by_name(path, expected, strict=True, aliases=aliases, known=engine.model_names())
    engine.load_model_state_dict({name: tensors[name] if name in tensors else tensors[aliases[name]]
                                  for name in expected})


def _storage_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name of the same tensor (a tied weight's second name) in a state dict."""
    first, aliases = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """name -> the first name of the same parameter (a tied weight), in checkpoint names."""
    first, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[canonical_name(name)] = first[id(p)]
        else:
            first[id(p)] = canonical_name(name)
    return aliases


def _read_by_name(path: Path, expected: dict[str, torch.Tensor], strict: bool, aliases: dict[str, str] | None = None,
                  known: set[str] | None = None):
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
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in stored.items() if name in expected}
    unexpected = sorted(stored.keys() - (expected.keys() if known is None else known))
    aliases = _storage_aliases(expected) if aliases is None else aliases
    missing = [n for n in expected if n not in stored and aliases.get(n) not in tensors]
    if strict and unexpected:
        raise LmforgeError(f"checkpoint {path} holds {_listed(unexpected)} tensors this model does not have: "
                           f"it was saved from a different model")
    if strict and missing:
        raise LmforgeError(f"checkpoint {path} lacks {_listed(missing)} of this model's tensors: it was "
                           f"saved from a different model")
    _load_or_corrupt(tensors, path, "model")
    return tensors, missing, unexpected


def read_tensors(path: Path, folder: str = "model") -> dict[str, torch.Tensor]:
    """Checkpoint `path`'s tensors of `folder` (model or optimizer) by name, in their stored dtype,
    on the CPU (one process)."""
    _refuse_old_format(path)
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in stored_tensors(path, folder).items()}
    _load_or_corrupt(tensors, path, folder)
    return tensors


def _refuse_old_format(path: Path) -> None:
    if not (path / "model").is_dir() and (path / "model.safetensors").is_file():
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (safetensors files, before "
                           f"distributed checkpoints): this version cannot read it; train it again")


def _load_or_corrupt(tensors: dict, path: Path, folder: str) -> None:
    try:
        load_tensors(tensors, path / folder)
    except CheckpointException as err:
        raise LmforgeError(f"checkpoint {path} is corrupt: {folder} could not be read ({_reason(err)})") from None


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
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in stored_tensors(path, "optimizer").items()}
    _load_or_corrupt(tensors, path, "optimizer")
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        name, field = key.rsplit(".", 1)
        state.setdefault(name, {})[field] = value
    engine.load_optimizer_state_dict({"state": state, "param_groups": param_groups})


def load_rng_states(path: Path, device: torch.device = torch.device("cpu")) -> None:
    """Restore the generators of this process (every rank gets the states rank 0 saved)."""
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
