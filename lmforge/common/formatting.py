"""Numbers and text as people read them (no torch: `lmforge runs` and the CLI use these too)."""

import unicodedata


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
