"""What lmforge tells its user: errors, warnings, and numbers and text as people read them.

Anything the user can fix (a bad config key, a missing file, a corrupt checkpoint) is raised as
`LmforgeError` with one line that names the problem and what to do. The CLI prints that line and
exits with status 2; so does an `OSError` (a full disk, a read-only folder: the machine, not the
program), through `os_error_message`, and memory that cannot be allocated (`MemoryError`, or
torch's allocator refusing), through `memory_error_message`. Any other exception is a bug and
keeps its traceback.
A warning (`warn`) is one line on stderr, `lmforge: warning: ...`, for a setting that is allowed
but probably not meant; the command goes on. The human_* and format_* functions print sizes, counts
and times the way people read them (no torch: `lmforge runs` and the CLI use them too).
"""

import errno
import os
import re
import sys
import traceback
import unicodedata


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
        errno.EFBIG: "the file would pass the largest size allowed (ulimit -f, or the file system's): "
                     "raise the limit or use another disk",
    }.get(err.errno, "check the path and run again")
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or err} ({advice})"


# tokenizers and safetensors (Rust) raise a plain Exception for a failed write: "File too large (os
# error 27)" (std::io::Error's text), or "... IoError(Os { code: 28, kind: StorageFull, ... })"
_RUST_OS_ERROR = re.compile(r"os error (\d+)|Os \{ code: (\d+)")


def as_os_error(err: BaseException, path) -> BaseException:
    """`err` as the OSError it is, naming `path` if it names no file (a write() on a full disk names
    none): also the plain Exception of a Rust library that carries an OS error code. Any other
    exception is returned unchanged."""
    if isinstance(err, OSError):
        if err.filename is None:
            err.filename = str(path)
        return err
    found = _RUST_OS_ERROR.search(str(err)) if type(err).__name__ in ("Exception", "SafetensorError") else None
    if found is None:
        return err
    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code), str(path))


# torch's allocators refuse with a RuntimeError (CPU: "DefaultCPUAllocator: can't allocate memory: you
# tried to allocate N bytes"; CUDA: torch.OutOfMemoryError, a RuntimeError too, "Tried to allocate 2.00 GiB")
_ALLOCATOR_REFUSALS = ("can't allocate memory", "out of memory", "not enough memory")
_BYTES_TRIED = re.compile(r"allocate (\d+) bytes")


def memory_error_message(err: BaseException) -> str | None:
    """One line for memory that could not be allocated: how much (when the allocator says), where
    in lmforge it was asked for, and what to lower; None for an exception that is not that."""
    text = str(err)
    if not (isinstance(err, MemoryError) or (isinstance(err, RuntimeError)
                                             and any(words in text for words in _ALLOCATOR_REFUSALS))):
        return None
    tried = _BYTES_TRIED.search(text)
    how_much = f" {int(tried.group(1)) / 2**30:,.1f} GiB" if tried else ""
    # the innermost lmforge frame: what asked for the memory (a file name, not a traceback)
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if "/lmforge/" in frame.filename]
    where = ""
    if frames:
        frame = frames[-1]
        where = f" in lmforge/{frame.filename.rsplit('/lmforge/', 1)[1]}:{frame.lineno} ({frame.name})"
    return (f"out of memory: could not allocate{how_much}{where}; lower train.batch_size, train.seq_len or the "
            f"model's size (lmforge plan shows what a setup needs)")


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


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """`warn`, said once per process and by one process of a launch (RANK 0, or no torchrun):
    for what each rank, and several readers in one process, find alike (a fine-tuning base's
    damaged checkpoint)."""
    if message not in _WARNED and os.environ.get("RANK", "0") == "0":
        warn(message)
    _WARNED.add(message)


# -- numbers and text as people read them ------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f}"


def human_seconds(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:,.1f} days"
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    if s >= 1:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.1f} ms"


def format_duration(seconds: float) -> str:
    """An ETA: 4m05s, 1h12m."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def for_terminal(text: str) -> str:
    """`text` with its control characters but newline and tab escaped (NUL as \\x00, ESC as \\x1b):
    a model's output printed raw could clear the screen, move the cursor or ring the bell. For
    the terminal only; a file keeps the text as it is."""
    return "".join(char if char in "\n\t" or unicodedata.category(char) != "Cc" else repr(char)[1:-1]
                   for char in text)
