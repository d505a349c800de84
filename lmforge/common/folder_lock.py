"""One writer per folder: an exclusive `flock` on a lock file beside the folder.

The lock file for `runs/a` is `runs/.a.lock`; it sits beside the folder, not in it, so that a
run can be locked before its folder exists, and it holds the PID of the process that holds it,
for the message the next one prints. The lock belongs to an open file, so the kernel drops it
when the process dies in any way (kill -9 included): a stale lock file holds no lock. The file
is removed on release; since another process may have opened it just before, an acquirer checks
after locking that the path still names the file it locked, and tries again if not.
"""

import fcntl
import os
from pathlib import Path

from lmforge.common.errors import LmforgeError


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
