"""`lmforge runs`: the runs in a folder side by side, read from what each one leaves on disk.

A run folder holds config.yaml (its settings), metrics.jsonl (one record per log or evaluation)
and, once a session ends normally, summary.json. A training process holds an OS lock on the
run folder while it runs (common/folders.py); the lock dies with the process, so a run whose
lock can be taken is not running, however it ended: it *stopped* when its newest checkpoint holds
every step it logged (a SIGTERM or Ctrl-C saves before it stops), else it *crashed* (a kill -9, a lost
node): what it logged after that checkpoint is lost, and a resume starts from the checkpoint's step,
which is the step shown. Imports no torch: listing finished runs answers
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
from lmforge.common.folders import is_locked
from lmforge.config import SECTIONS, Config, set_value
from lmforge.runs.checkpoint.find import check_whole_config, list_checkpoints, read_state
from lmforge.runs.metrics import read_metrics
from lmforge.runs.plots import batch_label, model_label


@dataclass
class Run:
    path: Path
    cfg: Config
    parameters: int
    step: int  # the last step logged
    saved: int  # the newest checkpoint's step (0: none), where a resume starts
    val_loss: float | None  # the last evaluation's
    tokens_per_s: float | None
    mfu: float | None
    status: str  # running | finished | stopped | crashed
    curves: list[dict]  # the records of metrics.jsonl


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def saved_step(path: Path) -> int:
    """The step of the run's newest complete checkpoint, from its folder's name; 0 without one."""
    found = list_checkpoints(path)
    return int(found[-1].name.removeprefix("step_")) if found else 0


def checkpoint_parameters(path: Path) -> int | None:
    """Parameters of the newest checkpoint (tied tensors counted once), from its state.json. No torch."""
    found = list_checkpoints(path)
    if not found:
        return None
    try:
        return read_state(found[-1]).get("parameters")
    except LmforgeError:
        return None


def read_config(path: Path) -> Config:
    """The run's config.yaml, read leniently: settings this version does not know are left out,
    so that runs written by other versions still list; a known one of the wrong type stops in one line."""
    file = path / "config.yaml"
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise LmforgeError(f"{file} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise LmforgeError(f"{file} must hold a mapping of sections (model, data, optim, train)")
    check_whole_config(path)  # else its defaults would be listed as the run's model and steps
    cfg = Config()
    for section in SECTIONS:
        values = data.get(section) or {}
        if not isinstance(values, dict):
            raise LmforgeError(f"{file}: {section!r} must be a section holding key: value pairs")
        known = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        for key, value in values.items():
            if key in known:
                set_value(cfg, f"{section}.{key}", value, origin=str(file))
    return cfg


# summary.json's fields `lmforge runs` and `scaling fit` read: (types, required)
SUMMARY_FIELDS = {"steps": (int, True), "tokens_trained": (int, False), "val_loss": ((int, float), False),
                  "tokens_per_s": ((int, float), False), "mfu": ((int, float), False), "parameters": (int, False)}


def read_summary(path: Path, cut_off_ok: bool = True) -> dict | None:
    """The run's summary.json, its fields checked (one line naming the first that is missing or of
    the wrong type); None without one. Written at the very end, a summary cut off while written
    (not JSON) means the session did not end normally: None where `cut_off_ok`, else one line."""
    file = path / "summary.json"
    if not file.is_file():
        return None
    try:
        summary = json.loads(file.read_bytes())
    except ValueError:
        if cut_off_ok:
            return None
        raise LmforgeError(f"{file} is not JSON (cut off while written?): resume the run to write it again") from None
    if not isinstance(summary, dict):
        raise LmforgeError(f"{file} holds a JSON {type(summary).__name__}, expected an object of results")
    for key, (kinds, required) in SUMMARY_FIELDS.items():
        value = summary.get(key)
        if (value is None and required) or (value is not None and (not isinstance(value, kinds)
                                                                   or isinstance(value, bool))):
            raise LmforgeError(f"{file}: {key} is {'missing' if key not in summary else repr(value)}, "
                               f"expected {'an integer' if kinds is int else 'a number'}")
    return summary


def read_run(path: Path) -> Run:
    cfg = read_config(path)
    records = read_metrics(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
    summary = read_summary(path)
    # a summary counts only if it covers the whole run: an extended run that stopped keeps the old one
    finished = summary is not None and summary["steps"] >= cfg.train.max_steps
    step = max([r.get("step", 0) for r in records] + [summary["steps"] if finished else 0])
    if finished:  # the whole last session's average
        tokens_per_s, mfu = summary.get("tokens_per_s"), summary.get("mfu")
    else:  # the latest logged window's
        speed = [r for r in records if r.get("tokens_per_s") is not None]
        tokens_per_s, mfu = (speed[-1]["tokens_per_s"], speed[-1].get("mfu")) if speed else (None, None)
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    saved = summary["steps"] if finished else saved_step(path)
    status = "running" if is_locked(path) else "finished" if finished else "stopped" if step <= saved else "crashed"
    # the count the run's summary or newest checkpoint holds spares building the model (and torch)
    parameters = (summary or {}).get("parameters") or checkpoint_parameters(path) or parameter_count(cfg.model)
    return Run(path=path, cfg=cfg, parameters=parameters, step=step, saved=saved,
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
    colors = {"running": "yellow", "finished": "green", "stopped": "red", "crashed": "bold red"}
    for run in runs:
        table.add_row(run.path.name, model_label(run.cfg.model), f"{run.parameters / 1e6:.2f}M",
                      run.cfg.train.precision, batch_label(run.cfg), steps_label(run),
                      f"{run.val_loss:.4f}" if run.val_loss is not None else "-",
                      f"{run.tokens_per_s:,.0f}" if run.tokens_per_s is not None else "-",
                      f"{run.mfu:.1%}" if run.mfu is not None else "-",
                      f"[{colors[run.status]}]{run.status}[/]")
    console.print(table)


def steps_label(run: Run) -> str:
    """Steps done of train.max_steps: a running run's logged progress; otherwise what is on disk
    (a crashed run's lost steps named beside it)."""
    done = run.step if run.status == "running" else run.saved
    lost = f" (logged {run.step:,}, lost)" if run.status == "crashed" else ""
    return f"{done:,} / {run.cfg.train.max_steps:,}{lost}"


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
