"""The trainer's end-of-run table: what the plan predicted beside what the run measured
(train/summary.py pairs them)."""

from rich.console import Console
from rich.table import Table

from lmforge.common.errors import human_bytes, human_seconds


def print_comparison(console: Console, comparison: dict) -> None:
    """The trainer's end-of-run table: each {"predicted", "measured"} pair and their ratio."""
    table = Table(title="predicted (plan) vs measured", title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column else "left")
    for row in comparison_rows(comparison):
        table.add_row(*row)
    console.print(table)


COLUMNS = ("", "predicted", "measured", "measured / predicted")


def comparison_rows(comparison: dict) -> list[tuple[str, str, str, str]]:
    """Each {"predicted", "measured"} pair as the table shows it (`lmforge report` writes the same rows)."""
    labels = {"step_seconds": "step time (roofline)", "mfu": "MFU", "hfu": "HFU (with recomputation)",
              "parameters_bytes": "parameters", "gradients_bytes": "gradients",
              "optimizer_states_bytes": "optimizer states",
              "activations_bytes": "saved for backward, one micro-batch", "peak_memory_bytes": "peak memory (CUDA)",
              "sent_bytes_per_step": "sent per step per rank (collectives)",
              "tp_sent_bytes_per_step": "sent per step per rank (tensor-parallel activations)",
              "cp_sent_bytes_per_step": "sent per step per rank (context-parallel ring)",
              "activations_in_flight_bytes": "saved for backward, peak alive at once"}
    rows = []
    for key, row in comparison.items():
        predicted, measured = row["predicted"], row["measured"]
        if key.startswith("stage "):  # a pipeline stage's row: "stage 1 activations_bytes"
            _, stage, name = key.split(" ", 2)
            label = f"stage {stage}: {labels[name]}"
        else:
            label = labels[key]
        if "_bytes" in key:
            shown = (human_bytes(predicted), human_bytes(measured) if measured is not None else "not measured")
        elif key == "step_seconds":
            shown = (human_seconds(predicted), human_seconds(measured))
        else:
            shown = (f"{predicted:.0%}", f"{measured:.1%}")
        ratio = f"{measured / predicted:.3f}" if measured is not None and predicted else "-"
        rows.append((label, *shown, ratio))
    return rows
