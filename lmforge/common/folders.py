"""Folders on disk: one writer at a time, and written whole or not at all.

One writer per folder: an exclusive `flock` on a lock file beside the folder.

The lock file for `runs/a` is `runs/.a.lock`; it sits beside the folder, not in it, so that a
run can be locked before its folder exists, and it holds the PID of the process that holds it,
for the message the next one prints. The lock belongs to an open file, so the kernel drops it
when the process dies in any way (kill -9 included): a stale lock file holds no lock. The file
is removed on release; since another process may have opened it just before, an acquirer checks
after locking that the path still names the file it locked, and tries again if not.

Folders written whole or not at all: written under a hidden staging name beside their place,
then renamed into it, so that a kill at any moment leaves either the old folder or the new one.

Checkpoints (runs/checkpoint/write.py), exported or imported run folders (runs/folders.py) and
eval-format's results (structured/evaluate.py) are written this way: `.<name>.partial` while being
written, `.<name>.stale` for the moment an old folder of the same name is swapped out. A single
file (`lmforge tasks`' .jsonl, the charts of `plan --plot` and `runs --plot`, a run's config.yaml
and tokenizer.json) is written the same way by `write_file_staged`. A failure (a full
disk: OSError) leaves no partial file or folder behind.
"""

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lmforge.common.errors import LmforgeError, as_os_error


def lock_path(folder: Path) -> Path:
    folder = Path(os.path.abspath(folder))
    return folder.parent / f".{folder.name}.lock"


def is_locked(folder: str | Path) -> bool:
    """Whether a live process holds the lock on `folder` (tested by trying to take it for a moment)."""
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if it was taken
    return False


class FolderLock:
    """Hold the lock on `folder` from construction until `release()` (or process exit).

    Raises LmforgeError naming the holder's PID when another process holds it; `doing` says
    what the holder is doing, for that message (e.g. "training", "preparing data")."""

    def __init__(self, folder: str | Path, doing: str):
        self.folder, self.path = Path(folder), lock_path(folder)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                who = f"process {holder}" if holder.isdigit() else "another process"
                raise LmforgeError(f"{self.folder} is locked by {who} ({doing}; lock file {self.path}): "
                                   f"wait for it to finish, or stop it, and run again") from None
            try:
                same_file = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:  # its holder released (removed) it between our open and lock
                same_file = False
            if same_file:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        # remove the file while still holding the lock: whoever opened it meanwhile sees it gone
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


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
        err = as_os_error(err, out)
        if isinstance(err, OSError):  # named as the file asked for, not its hidden staging name
            err.filename, err.filename2 = str(out), None
        raise err
    finally:
        staging.unlink(missing_ok=True)

