"""The table of `lmforge plan --compare`: one row per setup, the options that vary and what each
setup costs (training or inference)."""

from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.plan.show import wide
from lmforge.common.errors import human_bytes, human_seconds

# The columns of `--compare`: (label, how to show it) for each kind of plan
TRAINING_COLUMNS = [
    ("memory/device", lambda p: human_bytes(p["memory"]["per_device_bytes"])),
    ("fits", lambda p: "yes" if p["memory"]["fits"] else "NO"),
    ("time/step", lambda p: human_seconds(p["time"]["seconds_per_step"])),
    # time is at the assumed MFU, which counts no recomputation: say what recomputation adds
    ("recompute FLOPs", lambda p: f"+{p['flops']['hardware_per_token'] / p['flops']['training_per_token'] - 1:.0%}"),
    ("tokens/s", lambda p: f"{p['time']['tokens_per_second']:,.0f}"),
    ("bubble", lambda p: f"{p['pipeline']['bubble_fraction']:.0%}" if "pipeline" in p else "-"),
    ("devices", lambda p: str(p["setup"]["devices"])),
    ("device-hours", lambda p: f"{p['budget']['device_hours']:,.0f}"),
]
INFERENCE_COLUMNS = [
    ("weight bytes", lambda p: human_bytes(sum(p["memory"]["weights_bytes"].values()))),
    ("KV cache", lambda p: human_bytes(p["memory"]["kv_cache_bytes"])),
    ("fits", lambda p: "yes" if p["memory"]["fits"] else "NO"),
    ("largest batch", lambda p: f"{p['memory']['largest_batch']:,}"),
    ("prefill", lambda p: human_seconds(p["prefill"]["seconds"])),
    ("decode step", lambda p: human_seconds(p["decode"]["seconds_per_step"])),
    ("tokens/s/device", lambda p: f"{p['decode']['tokens_per_second_per_device']:,.1f}"),
]


def compare_label(plan: dict, varying: list[str]) -> str:
    """What sets a plan apart in a comparison: the values of the options that vary."""
    st = plan["setup"]
    return ", ".join(f"{name.replace('_', ' ')} {st[name]}" for name in varying)


def print_comparison_table(console: Console, plans: list[dict], varying: list[str], title: str) -> None:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    columns = INFERENCE_COLUMNS if "decode" in plans[0] else TRAINING_COLUMNS
    for name in varying:
        table.add_column(name.replace("_", " "), justify="right", no_wrap=True)
    for label, _ in columns:
        table.add_column(label, justify="right", no_wrap=True)
    for plan in plans:
        fits = plan["memory"]["fits"]
        table.add_row(*(str(plan["setup"][name]) for name in varying), *(show(plan) for _, show in columns),
                      style=None if fits else "red")
    # one line per setup, even where the output is a narrow pipe
    wide(console, 150).print(table)
