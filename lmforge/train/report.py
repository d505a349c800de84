"""What a run leaves for people: metrics.jsonl, loss.png and the end-of-run summary table."""

import dataclasses
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmforge.config import MODEL_PRESETS, Config, ModelConfig
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
    """The records of a metrics.jsonl. A last line cut short (the run was killed while writing it)
    is left out; a damaged line before it is an error."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise LmforgeError(f"{path} line {number} is not JSON: the file is damaged") from None
    return records


def model_label(m: ModelConfig) -> str:
    """The preset's name when the shape is one (how attention is computed does not change it), else
    the family and shape: "small" or "llama 8x384"."""
    shape = {**dataclasses.asdict(m), "attention": "sdpa", "dropout": 0.0}
    for name, preset in MODEL_PRESETS.items():
        if dataclasses.asdict(ModelConfig(**preset)) == shape:
            return name
    return f"{m.family} {m.n_layers}x{m.d_model}"


def batch_label(cfg: Config) -> str:
    """Sequences x tokens per micro-batch, and the accumulation: "8x256" or "8x256 x4 accum"."""
    accum = f" x{cfg.train.grad_accum} accum" if cfg.train.grad_accum > 1 else ""
    return f"{cfg.train.batch_size}x{cfg.seq_len}{accum}"


def run_title(name: str, cfg: Config, parameters: int) -> str:
    """Two lines naming a run and the settings that shape its curves."""
    return (f"{name}: {model_label(cfg.model)}, {parameters / 1e6:.2f}M parameters\n"
            f"batch {batch_label(cfg)}, {cfg.train.precision}, lr {cfg.optim.lr:g} "
            f"(warmup {cfg.optim.warmup_steps}), {cfg.train.max_steps} steps")


def plot_losses(metrics_path: Path, png_path: Path, title: str, unigram_entropy: float | None = None,
                tokens_per_step: int | None = None) -> None:
    """Three panels against the step: training and validation loss (with the unigram-entropy
    baseline), learning rate, tokens/s; tokens seen on the top axis when tokens_per_step is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    records = read_metrics(metrics_path)

    def series(key):
        return list(zip(*[(r["step"], r[key]) for r in records if r.get(key) is not None])) or [(), ()]

    fig, (ax_loss, ax_lr, ax_speed) = plt.subplots(3, 1, figsize=(7.5, 7.5), dpi=120, sharex=True,
                                                   gridspec_kw={"height_ratios": [3, 1.2, 1.2]})
    ax_loss.plot(*series("train_loss"), label="train", color="tab:blue", linewidth=1.2)
    ax_loss.plot(*series("val_loss"), "o-", label="validation", color="tab:orange", markersize=4)
    if unigram_entropy is not None:
        ax_loss.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1,
                        label=f"unigram entropy ({unigram_entropy:.2f})")
    ax_loss.set_ylabel("cross-entropy\n(nats/token)")
    ax_loss.legend()
    if tokens_per_step:
        tokens = ax_loss.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step,
                                                           lambda n: n / tokens_per_step))
        tokens.set_xlabel("tokens seen")
        tokens.xaxis.set_major_formatter(EngFormatter())
    ax_lr.plot(*series("lr"), color="tab:green", linewidth=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_speed.plot(*series("tokens_per_s"), color="tab:purple", linewidth=1.2)
    ax_speed.set_ylabel("tokens/s")
    ax_speed.yaxis.set_major_formatter(EngFormatter())
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_xlabel("step")
    for ax in (ax_loss, ax_lr, ax_speed):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
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
