"""User-facing errors.

Anything the user can fix (a bad config key, a missing file, a corrupt checkpoint) is raised as
`LmforgeError` with one line that names the problem and what to do. The CLI prints that line and
exits with status 2; so does an `OSError` (a full disk, a read-only folder: the machine, not the
program), through `os_error_message`. Any other exception is a bug and keeps its traceback.
A warning (`warn`) is one line on stderr, `lmforge: warning: ...`, for a setting that is allowed
but probably not meant; the command goes on.
"""

import errno
import sys


class LmforgeError(Exception):
    """An error caused by user input, reported as one line without a traceback."""


def os_error_message(err: OSError) -> str:
    """One line for a failed file operation: the path, the system's reason, and what to do."""
    advice = {
        errno.ENOSPC: "free some space, or use a folder on another disk, and run again",
        errno.EDQUOT: "free some space (disk quota), or use a folder on another disk, and run again",
        errno.EROFS: "the file system is read-only: use a folder on a writable disk",
        errno.EACCES: "check the folder's permissions, or use another folder",
        errno.EPERM: "check the folder's permissions, or use another folder",
        errno.ENOTDIR: "a file stands where a folder is needed: use another path",
        errno.EISDIR: "a folder stands where a file is needed: use another path",
        errno.EEXIST: "something already exists at that path: use another path",
    }.get(err.errno, "check the path and run again")
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or err} ({advice})"


class UnknownName(LmforgeError, ValueError):
    """A name missing from one of lmforge's registries (precision policies, attention backends,
    recompute modes, fp8 scalings): the user's to fix (one line in the CLI), and to a library
    caller a bad argument, the ValueError it would expect."""


def lookup(registry, name: str, kind: str):
    """`registry[name]`, or UnknownName saying "unknown <kind> <name>; choose one of ..."."""
    if name not in registry:
        raise UnknownName(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def warn(message: str) -> None:
    print(f"lmforge: warning: {message}", file=sys.stderr, flush=True)
