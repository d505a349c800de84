"""`lmforge runs`: the runs in a folder side by side, read from what each one leaves on disk.

A run folder holds config.yaml (its settings), metrics.jsonl (one record per log or evaluation)
and, once a session ends normally, summary.json. A training process holds an OS lock on the
run folder while it runs (common/folder_lock.py); the lock dies with the process, so a run whose
lock can be taken is not running, however it ended. Imports no torch: listing finished runs answers
at once; a run without a summary has its parameters counted from its model built on the meta
device (accounting/shapes.py), which loads torch (about 2 s, once), unless it has a checkpoint,
whose state.json holds the count.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.memory import parameter_count
from lmforge.common.errors import LmforgeError
from lmforge.common.folder_lock import is_locked
from lmforge.config import SECTIONS, Config
from lmforge.runs.checkpoint.find import list_checkpoints, read_state
from lmforge.runs.metrics import read_metrics
from lmforge.runs.plots import batch_label, model_label


@dataclass
class Run:
    path: Path
    cfg: Config
    parameters: int
    step: int  # the last step logged
    val_loss: float | None  # the last evaluation's
    tokens_per_s: float | None
    mfu: float | None
    status: str  # running | finished | stopped
    curves: list[dict]  # the records of metrics.jsonl


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def checkpoint_parameters(path: Path) -> int | None:
    """Parameters of the newest checkpoint (tied tensors counted once), from its state.json. No torch."""
    found = list_checkpoints(path)
    if not found:
        return None
    try:
        return read_state(found[-1]).get("parameters")
    except (OSError, ValueError):
        return None


def read_config(path: Path) -> Config:
    """The run's config.yaml, read leniently: settings this version does not know are left out,
    so that runs written by other versions still list."""
    try:
        data = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except yaml.YAMLError as err:
        raise LmforgeError(f"{path}/config.yaml is not valid YAML: {str(err).splitlines()[0]}") from None
    cfg = Config()
    for section in SECTIONS:
        target = getattr(cfg, section)
        known = {f.name for f in dataclasses.fields(target)}
        values = {k: v for k, v in (data.get(section) or {}).items() if k in known}
        setattr(cfg, section, dataclasses.replace(target, **values))
    return cfg


def read_run(path: Path) -> Run:
    cfg = read_config(path)
    records = read_metrics(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = None  # written at the very end: damaged means the session did not end normally
    # a summary counts only if it covers the whole run: an extended run that stopped keeps the old one
    finished = summary is not None and summary.get("steps", 0) >= cfg.train.max_steps
    step = max([r.get("step", 0) for r in records] + [summary["steps"] if finished else 0])
    if finished:  # the whole last session's average
        tokens_per_s, mfu = summary["tokens_per_s"], summary["mfu"]
    else:  # the latest logged window's
        speed = [r for r in records if r.get("tokens_per_s") is not None]
        tokens_per_s, mfu = (speed[-1]["tokens_per_s"], speed[-1].get("mfu")) if speed else (None, None)
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    status = "running" if is_locked(path) else "finished" if finished else "stopped"
    # the count the run's summary or newest checkpoint holds spares building the model (and torch)
    parameters = (summary or {}).get("parameters") or checkpoint_parameters(path) or parameter_count(cfg.model)
    return Run(path=path, cfg=cfg, parameters=parameters, step=step,
               val_loss=val[-1] if val else None, tokens_per_s=tokens_per_s, mfu=mfu, status=status, curves=records)


def find_runs(folder: str | Path) -> list[Run]:
    """The runs in `folder` by name, or `folder` itself if it is a run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LmforgeError(f"no folder {folder}: name the folder that holds the runs, e.g. lmforge runs runs")
    if is_run(folder):
        return [read_run(folder)]
    return [read_run(path) for path in sorted(folder.iterdir()) if is_run(path)]


def print_runs(runs: list[Run], folder: str | Path, console: Console | None = None) -> None:
    # off a terminal (a pipe, a log) rich would squeeze the table into 80 columns
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    if not runs:
        console.print(f"no runs in {folder} (a run folder holds config.yaml)")
        return
    table = Table(title=f"runs in {folder}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("run", "model", "params", "precision", "batch", "steps", "val loss", "tokens/s", "MFU", "status"):
        table.add_column(column, justify="left" if column in ("run", "model", "precision", "status") else "right",
                         no_wrap=True)
    colors = {"running": "yellow", "finished": "green", "stopped": "red"}
    for run in runs:
        table.add_row(run.path.name, model_label(run.cfg.model), f"{run.parameters / 1e6:.2f}M",
                      run.cfg.train.precision, batch_label(run.cfg), f"{run.step:,} / {run.cfg.train.max_steps:,}",
                      f"{run.val_loss:.4f}" if run.val_loss is not None else "-",
                      f"{run.tokens_per_s:,.0f}" if run.tokens_per_s is not None else "-",
                      f"{run.mfu:.1%}" if run.mfu is not None else "-",
                      f"[{colors[run.status]}]{run.status}[/]")
    console.print(table)


def resolve_runs(folder: str | Path, names: list[str]) -> list[Run]:
    """Each name is a run folder's path, or a run's name inside `folder`; no names: every run there."""
    if not names:
        runs = find_runs(folder)
        if not runs:
            raise LmforgeError(f"no runs in {folder} to plot (a run folder holds config.yaml)")
        return runs
    runs = []
    for name in names:
        path = Path(name) if is_run(Path(name)) else Path(folder) / name
        if not is_run(path):
            raise LmforgeError(f"{name} is not a run: give run folders, or names of runs in {folder}")
        runs.append(read_run(path))
    return runs


def plot_runs(folder: str | Path, names: list[str], png_path: str | Path) -> None:
    """Training (line) and validation (dots) loss of several runs against tokens seen: runs with
    different batches line up by the data they have seen, not by their step counts."""
    runs = resolve_runs(folder, names)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colors = plt.get_cmap("tab10").colors
    for index, run in enumerate(runs):
        color = colors[index % 10]
        tokens_per_step = run.cfg.train.batch_size * run.cfg.train.grad_accum * run.cfg.seq_len
        label = (f"{run.path.name} ({model_label(run.cfg.model)}, {run.cfg.train.precision}, "
                 f"batch {batch_label(run.cfg)}, lr {run.cfg.optim.lr:g})")
        for key, style in (("train_loss", dict(linewidth=1.2, label=label)),
                           ("val_loss", dict(marker="o", markersize=4, linestyle=":"))):
            points = [(r["step"] * tokens_per_step, r[key]) for r in run.curves if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, **style)
    ax.set_xlabel("tokens seen")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{len(runs)} runs: training loss (lines), validation loss (dots)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
