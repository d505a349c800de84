"""Folders written whole or not at all: written under a hidden staging name beside their place,
then renamed into it, so that a kill at any moment leaves either the old folder or the new one.

Checkpoints (runs/checkpoint/write.py), exported or imported run folders (runs/folders.py) and
eval-format's results (structured/evaluate.py) are written this way: `.<name>.partial` while being
written, `.<name>.stale` for the moment an old folder of the same name is swapped out. A single
file (`lmforge tasks`' .jsonl, the charts of `plan --plot` and `runs --plot`, a run's config.yaml
and tokenizer.json) is written the same way by `write_file_staged`. A failure (a full
disk: OSError) leaves no partial file or folder behind.
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lmforge.common.errors import as_os_error


def staging_path(final: Path) -> Path:
    """The hidden folder `final` is written in before it is renamed into place."""
    return final.parent / f".{final.name}.partial"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename into it included) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(staging: Path, final: Path) -> None:
    """Rename the complete folder `staging` to `final`, replacing a folder already there (the same
    checkpoint step saved again, an empty --out); the rename is synced to disk."""
    if final.exists():
        stale = final.parent / f".{final.name}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        os.rename(staging, final)
        shutil.rmtree(stale)
    else:
        os.rename(staging, final)
    fsync_dir(final.parent)


def write_staged(out: Path, write: Callable[[Path], None]) -> None:
    """Call write(folder) on a fresh staging folder for `out` (one process), then move it into
    place; on any failure the staging folder is removed and `out` is left as it was. A failed write
    is raised as an OSError naming `out` (common/errors.as_os_error), for the CLI's one line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(out)
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed earlier attempt
    try:
        staging.mkdir()
        write(staging)
        move_into_place(staging, out)
    except Exception as err:
        raise as_os_error(err, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_file_staged(out: Path, write: Callable[[Path], None]) -> None:
    """Call write(path) on a hidden staging file beside `out`, then rename it onto `out`; on any
    failure the staging file is removed and `out` is left as it was."""
    staging = out.parent / f".{out.stem}.partial{out.suffix}"  # the suffix kept: matplotlib reads the format from it
    try:
        write(staging)
        os.replace(staging, out)
        fsync_dir(out.parent)
    except Exception as err:
        raise as_os_error(err, out)
    finally:
        staging.unlink(missing_ok=True)

