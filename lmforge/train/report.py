"""What a run leaves for people: metrics.jsonl, loss.png and the end-of-run summary table."""

import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmforge.errors import LmforgeError


class MetricsLog:
    """Append-only JSON lines, one record per log or eval event, each with its `step`.

    On resume the file is first rewritten to the lines `lines_to_keep` chose (the records up to
    the checkpoint's step: later ones belong to the part of the interrupted run that is being
    redone), so that it reads as one uninterrupted run.
    """

    def __init__(self, path: Path, keep: list[str] | None = None):
        self.path = path
        if keep is not None and path.exists():
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)
        self._file = open(path, "a")

    @staticmethod
    def lines_to_keep(path: Path, step: int, warn) -> list[str]:
        """The lines of `path` with records up to `step`; reads only. A cut-off last line (what a
        full disk or a kill mid-write leaves) is dropped with a warning; damage elsewhere stops."""
        if not path.exists():
            return []
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    warn(f"{path} ends in a cut-off line (a full disk or a kill while writing it): dropped it")
                    break
                raise LmforgeError(f"{path} line {number} is not JSON: the file is damaged; "
                                   f"delete that line (or the file) and resume again") from None
            if record.get("step", 0) <= step:
                kept.append(line)
        return kept

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:  # a write to an open file does not name it: add the path
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # the buffered rest could not be flushed (full disk): the write that failed said so


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
