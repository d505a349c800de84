"""The pieces the plan's terminal tables share (show.py for training, show_inference.py for serving)."""

from rich.table import Table

from lmforge.common.formatting import human_bytes

# What the tables and charts call the parts of a training plan's memory (plan["memory"]["breakdown_bytes"])
MEMORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "optimizer states",
    "weight_copies": "low-precision weight copies",
    "activations": "activations (saved for backward)",
    "logits": "logits + fp32 loss copy",
}


def labelled_parts(breakdown: dict) -> list[tuple[str, float]]:
    """A training plan's non-zero memory parts (plan["memory"]["breakdown_bytes"]), by their labels."""
    return [(MEMORY_LABELS.get(key, key), value) for key, value in breakdown.items() if value]


def facts_table(title: str, rows: list[tuple[str, str]] = ()) -> Table:
    """A two-column table of (what, value) rows, without a header."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def memory_table(title: str, parts: list[tuple[str, float]], mem: dict, hardware: str) -> Table:
    """Memory per device: each non-zero part with its share of the total, the total, then the
    reserve and whether total + reserve fits the device."""
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = mem["per_device_bytes"]
    for label, value in parts:
        if value:
            table.add_row(label, human_bytes(value), f"{value / total:.1%}")
    table.add_row("total", human_bytes(total), "", style="bold")
    reserve = mem["reserve_bytes"]
    table.add_row("reserve (--reserve: CUDA context, fragmentation)", human_bytes(reserve), "", style="dim")
    verdict = "fits" if mem["fits"] else "does NOT fit"
    table.add_row(f"device memory ({hardware}, as the device reports it)", human_bytes(mem["device_memory_bytes"]),
                  f"{verdict} ({(total + reserve) / mem['device_memory_bytes']:.0%})",
                  style="green" if mem["fits"] else "red")
    return table
