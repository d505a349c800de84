"""`lmforge report RUN`: report.md, the page a person shares about a run, read from what the run
folder holds: its config, the data it trained on, the cost (the end-of-run summary table, and the
plan's predictions beside what was measured), the loss curves (loss.png), the evaluation scores over
training (metrics.jsonl) and at the end (summary.json, and eval.json of `lmforge eval`), and the
sample. Every number is shown by the function that shows it at the end of training, so the page and
the terminal always agree.

A run that did not end normally (crashed, stopped, still running) has no summary of its own: its
report says so and shows what it logged. A folder that is not a run, or a damaged summary.json,
metrics.jsonl or eval.json, is refused in one line before anything is written.
"""

import json
from pathlib import Path

from lmforge.accounting.plan.make import matmul_dtype
from lmforge.accounting.plan.tables import COLUMNS, comparison_rows
from lmforge.common.errors import LmforgeError
from lmforge.common.folders import write_file_staged
from lmforge.config import Config
from lmforge.data.prepare import data_dir_of, read_meta, tokens_line
from lmforge.eval.metrics import table
from lmforge.eval.tasks import TITLES
from lmforge.runs.listing import Run, is_run, read_run, read_summary, steps_label
from lmforge.runs.plots import plot_losses, run_title
from lmforge.train.evaluate import evaluation_line, record_scores, task_rows
from lmforge.train.report import metrics_line
from lmforge.train.summary import summary_rows

REPORT = "report.md"


def write_report(run_dir: str | Path) -> Path:
    """Read the run folder, draw loss.png if it is missing or older than metrics.jsonl (a run that did
    not end normally), and write RUN/report.md; returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not is_run(run_dir):
        raise LmforgeError(f"{run_dir} is not a run folder (a run folder holds config.yaml): name one, "
                           f"e.g. lmforge report runs/<name>")
    summary = read_summary(run_dir, cut_off_ok=False)  # a damaged one: one line
    if summary:  # the folder where the run lies now: a moved or copied run's summary names where it trained
        summary = {**summary, "run_dir": str(run_dir.resolve())}
    run = read_run(run_dir)  # config.yaml and metrics.jsonl, checked; the run's status
    evaluated = read_eval(run_dir / "eval.json")
    meta = prepared_meta(run.cfg)
    page = "\n\n".join([*heading(run, summary), *config_section(run_dir), *data_section(run, meta),
                        *checked(run_dir / ("summary.json" if summary else "metrics.jsonl"),
                                 lambda: cost_section(run, summary)), *curves_section(run),
                        *checked(f"{run_dir / 'metrics.jsonl'} or summary.json",
                                 lambda: eval_section(run, summary, evaluated)),
                        *sample_section(run_dir, summary)]) + "\n"
    metrics, png = run_dir / "metrics.jsonl", run_dir / "loss.png"
    if run.curves and (not png.is_file() or png.stat().st_mtime < metrics.stat().st_mtime):
        write_file_staged(png, lambda path: draw_losses(run, meta, path))
    out = run_dir / REPORT
    write_file_staged(out, lambda path: path.write_text(page, encoding="utf-8"))
    return out


def checked(file: str | Path, section) -> list[str]:
    """`section()`, whose numbers come from `file`: a field missing there, or of the wrong type, is
    one line naming it (read_summary and read_metrics check only the fields `lmforge runs` reads)."""
    try:
        return section()
    except (KeyError, TypeError, ValueError) as err:
        raise LmforgeError(f"{file} is damaged ({type(err).__name__}: {err}): not what lmforge train writes; "
                           f"resume the run to write it again") from None


def heading(run: Run, summary: dict | None) -> list[str]:
    name, details = run_title(run.path.name, run.cfg, run.parameters).split("\n", 1)
    status = f"**Status: {run.status}**, steps {steps_label(run)}."
    if summary is None:
        status += (" It has no summary.json: the run did not end normally (or is still running), so this page shows "
                   "what it logged, without the end-of-run summary, sample or plan comparison.")
    elif run.status != "finished":
        status += f" Its summary.json is of an earlier session, which ended at step {summary['steps']:,}."
    return [f"# {name}", details, status]


def config_section(run_dir: Path) -> list[str]:
    # folded (GitHub and most viewers open it on a click): the whole file, that reproduces the run
    return ["## Config", "<details><summary>config.yaml, as the run wrote it</summary>",
            fenced((run_dir / "config.yaml").read_text(errors="replace"), "yaml"), "</details>"]


def prepared_meta(cfg: Config) -> dict | Exception | None:
    """meta.json of the data a run from scratch trained on; the error that says why it cannot be
    read here (another machine's data, or gone); None for a fine-tuning run (its examples are read
    from data.source, not prepared)."""
    if cfg.finetune.base is not None:
        return None
    try:
        return read_meta(data_dir_of(cfg))
    except (LmforgeError, OSError) as err:
        return err


def data_section(run: Run, meta: dict | Exception | None) -> list[str]:
    """The corpus it trained on, as `lmforge prepare` described it (meta.json)."""
    cfg = run.cfg
    if meta is None:
        return ["## Data", f"- fine-tuned from `{cfg.finetune.base}` on `{cfg.data.source}`"]
    lines = [f"- source: `{cfg.data.source}`", f"- prepared data: `{data_dir_of(cfg)}`"]
    if isinstance(meta, Exception):
        lines.append(f"- not readable here ({meta})")
    else:
        lines += [f"- tokenizer: byte-level BPE, {meta['tokenizer_vocab_size']:,} tokens",
                  f"- documents: {meta['splits']['train']['documents']:,} train, "
                  f"{meta['splits']['val']['documents']:,} validation",
                  f"- tokens: {tokens_line(meta)}"]
    return ["## Data", "\n".join(lines)]


def cost_section(run: Run, summary: dict | None) -> list[str]:
    if summary is None:  # the last training record, as the progress line showed it
        trained = [r for r in run.curves if "train_loss" in r]
        if not trained:
            return ["## Cost", "No training step was logged."]
        last = trained[-1]
        return ["## Cost", f"The last record logged (step {last['step']:,}, {last['tokens_seen']:,} tokens, "
                f"{last['elapsed_s']:.0f} s in its session):", fenced(metrics_line(last))]
    rows = summary_rows(summary, matmul_dtype(run.cfg.train.precision), run.cfg.train.fp32_attention)
    parts = ["## Cost", "The end-of-run summary (`summary.json`):", markdown_table(("", ""), rows)]
    if summary.get("predicted_vs_measured"):
        parts += ["What the plan predicted at the start beside what the run measured:",
                  markdown_table(COLUMNS, comparison_rows(summary["predicted_vs_measured"]))]
    return parts


def curves_section(run: Run) -> list[str]:
    if not run.curves:
        return ["## Loss curves", "metrics.jsonl holds no records yet."]
    return ["## Loss curves", "![training and validation loss, learning rate, tokens/s](loss.png)"]


def eval_section(run: Run, summary: dict | None, evaluated: dict | None) -> list[str]:
    evaluations = [r for r in run.curves if r.get("val_loss") is not None]
    if not evaluations and evaluated is None:
        return []
    parts = ["## Evaluation"]
    if evaluations:
        parts += ["At each evaluation during training (validation loss; train.eval_tasks' scores):",
                  fenced("\n".join(evaluation_line(r["step"], r["val_loss"], record_scores(r)) for r in evaluations))]
    if summary is not None and "eval_tasks" in summary:
        parts += ["At the end of training:", markdown_table(("", ""), task_rows(summary["eval_tasks"]))]
    if evaluated is not None:
        parts += [f"`lmforge eval` (eval.json; its settings {json.dumps(evaluated['settings'])}):",
                  fenced(evaluated["table"]),
                  "![centered accuracy and bits per byte per task](eval.png)"]
    return parts


def sample_section(run_dir: Path, summary: dict | None) -> list[str]:
    path = run_dir / "sample.txt"
    if not path.is_file():
        return []
    prompt = (summary or {}).get("sample_prompt")
    said = f"Prompt {json.dumps(prompt)}, and the model's continuation" if prompt else "The end-of-run sample"
    return ["## Sample", f"{said}:", fenced(path.read_text(encoding="utf-8", errors="replace"))]


def read_eval(path: Path) -> dict | None:
    """eval.json of `lmforge eval` (None without one): its settings and its table as `lmforge eval`
    printed it; a damaged file is one line."""
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_bytes())
        return {"settings": dict(results["settings"]), "table": table(results["tasks"], TITLES)}
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        raise LmforgeError(f"{path} is damaged (not the eval.json lmforge eval writes): run lmforge eval again, "
                           f"or move it away") from None


def draw_losses(run: Run, meta: dict | Exception | None, png: Path) -> None:
    """loss.png as training draws it at its end (train/summary.py), from the records on disk."""
    trained = [r for r in run.curves if r.get("tokens_seen") and r.get("step")]
    plot_losses(run.path / "metrics.jsonl", png, title=run_title(run.path.name, run.cfg, run.parameters),
                unigram_entropy=meta["unigram_entropy_nats"] if isinstance(meta, dict) else None,
                tokens_per_step=trained[-1]["tokens_seen"] // trained[-1]["step"] if trained else None)


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(row) for row in rows)])


def fenced(text: str, language: str = "") -> str:
    """`text` in a code block whose fence no run of backticks in it can close."""
    longest, streak = 0, 0
    for char in text:
        streak = streak + 1 if char == "`" else 0
        longest = max(longest, streak)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip(chr(10))}\n{fence}"
