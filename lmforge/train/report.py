"""What a run leaves for people: metrics.jsonl, loss.png and the end-of-run summary table."""

import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table


class MetricsLog:
    """Append-only JSON lines, one record per log or eval event, each with its `step`.

    On resume, records after the checkpoint's step are dropped first (they belong to the part of
    the interrupted run that is being redone), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        self._file = open(path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path, title: str, unigram_entropy: float | None = None) -> None:
    """Training and validation loss against step, with the unigram-entropy baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", color="tab:orange", markersize=4)
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1,
                   label=f"unigram entropy ({unigram_entropy:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def print_table(console: Console, rows: list[tuple[str, str]], title: str) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
