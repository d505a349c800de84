"""A run's checkpoints on disk: which there are, which is the newest intact one, and whether a
checkpoint's files still match the manifest it was sealed with (checkpoint/__init__.py). Imports
no torch, so that `lmforge runs` can read checkpoints too."""

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.config import lacking_key

CHECKPOINT_DIR = "checkpoints"
# 3: torch.distributed.checkpoint folders. 2 (safetensors files, by parameter name) and 1 (no
# "format" in state.json; optimizer state by position) are refused with one line.
FORMAT = 3
STEP_PATTERN = re.compile(r"^step_(\d+)$")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_state(path: Path) -> dict:
    """Checkpoint `path`'s state.json; one line if it is unreadable, no object or its step no integer."""
    try:
        state = json.loads((path / "state.json").read_bytes())
    except (OSError, ValueError):
        raise LmforgeError(f"checkpoint {path} is corrupt: state.json unreadable") from None
    step = state.get("step", 0) if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise LmforgeError(f"checkpoint {path} is corrupt: state.json must be an object whose step is an integer")
    return state


def read_manifest(path: Path) -> dict[str, dict]:
    """Checkpoint `path`'s manifest: file name -> {"bytes", "sha256"}."""
    try:
        manifest = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError):
        raise LmforgeError(f"checkpoint {path} is corrupt: manifest.json unreadable") from None
    if not isinstance(manifest, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
            for entry in manifest.values()):
        raise LmforgeError(f"checkpoint {path} is corrupt: manifest.json must map each file to its bytes and sha256")
    return manifest


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_PATTERN.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))


def cut_short(run_dir: Path, checkpoint: Path | None) -> str | None:
    """The line that says run folder `run_dir`'s config.yaml is not the run's whole config, or None:
    it lacks a setting `checkpoint`'s copy holds (without a checkpoint: a section; config/load.py's
    lacking_key). Read as it is, its defaults would stand in for the run's settings."""
    ours = run_dir / "config.yaml"
    lacking = lacking_key(ours, checkpoint / "config.yaml" if checkpoint is not None else None)
    if lacking is None:
        return None
    fix = f"; copy checkpoint {checkpoint}'s config.yaml over it" if checkpoint is not None else ""
    return f"{ours} lacks {lacking} (cut short or edited){fix}"


def check_whole_config(run_dir: Path) -> None:
    """cut_short's line as an LmforgeError, against the run's newest checkpoint whose config.yaml
    reads (a damaged one is for a resume or a load to skip and say), or its sections without one."""
    for checkpoint in [*reversed(list_checkpoints(run_dir)), None]:
        try:
            problem = cut_short(run_dir, checkpoint)
        except LmforgeError:
            if checkpoint is None:  # the run's own config.yaml is unreadable
                raise
            continue
        if problem is not None:
            raise LmforgeError(problem)
        return


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
        except LmforgeError as err:
            problems.append(str(err))
            continue
        for problem in problems if warn is not None else ():  # said only when an earlier one is used
            warn(f"skipping {problem}")
        return path
    raise LmforgeError(problems[0] if len(problems) == 1 else f"{problems[0]} (and no earlier checkpoint is intact)")


def verify_checkpoint(path: Path) -> None:
    """Check every file against the manifest; a corrupt or incomplete checkpoint stops here."""
    for name, expected in read_manifest(path).items():
        file = path / name
        if not file.is_file():
            raise LmforgeError(f"checkpoint {path} is incomplete: {name} is missing")
        if file.stat().st_size != expected["bytes"] or file_sha256(file) != expected["sha256"]:
            raise LmforgeError(f"checkpoint {path} is corrupt: {name} does not match its checksum; "
                               f"resume from an earlier checkpoint or start a new run")


def check_format(path: Path, state: dict) -> None:
    """Stop with one line if checkpoint `path` (its state.json `state`) has an older format."""
    if state.get("format") == 2:
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (safetensors files, before "
                           f"distributed checkpoints): this version cannot resume it; start a new run")
    if state.get("format") != FORMAT:
        raise LmforgeError(f"checkpoint {path} was written by an older lmforge (optimizer state by position, "
                           f"not by parameter name): this version cannot resume it; start a new run")


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
