"""User-facing warnings: settings that are allowed but probably not meant.

An error (lmforge/errors.py) stops the command; a warning is one line on stderr,
`lmforge: warning: ...`, and the command goes on.
"""

import sys


def warn(message: str) -> None:
    print(f"lmforge: warning: {message}", file=sys.stderr, flush=True)
