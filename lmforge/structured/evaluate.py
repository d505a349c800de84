"""`lmforge eval-format`: the format-restriction study of Tam et al. 2024 on any model lmforge loads.

Each test task of lmforge/structured/tasks.py is answered under every condition asked for:
- free: the free-text prompt; the answer is what follows the last "the answer is";
- instructed: the prompt asks for JSON, YAML or XML, keys reasoning-first or answer-first, and
  nothing else enforces it;
- constrained: the same prompt, decoded under a grammar (constrain.py: format_grammar, llguidance): JSON
  matching a schema with the keys in the asked order (the answer typed: integer or string); YAML
  and XML through Lark grammars of the same two keys (llguidance has no general YAML or XML
  grammar; these fixed-key ones are context-free, and exclude what would not parse);
- converted: the free-text reply, then the model is asked to restate it in the format (reasoning
  first): the paper's NL-to-Format, with the model itself as the converter.
Decoding is greedy, so a run is deterministic. An answer is correct when its value, as a string
with case and surrounding space ignored, equals the task's; a parse error is a reply with no
answer to read (unparsable, no `answer` key, no "the answer is", or cut by --max-new-tokens in
constrained mode): it counts as wrong too. Rates come with 95% Wilson score intervals.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.common.folders import write_staged
from lmforge.structured.parse import FORMATS, ParseError, parse_answer
from lmforge.structured.tasks import KINDS, ORDERS, REASONING_KINDS, Task, conversion_prompt, make_tasks, prompt

MODES = ("free", "instructed", "constrained", "converted")


@dataclass(frozen=True)
class Condition:
    mode: str
    fmt: str  # "text" for free
    order: str = "reasoning-first"

    @property
    def label(self) -> str:
        if self.mode == "free":
            return "free text"
        return f"{self.mode} {self.fmt}" + (" answer-first" if self.order == "answer-first" else "")


def conditions(modes: list[str], formats: list[str]) -> list[Condition]:
    """The conditions of the study, in table order; LmforgeError for an unknown mode or format."""
    for name, given, known in (("mode", modes, MODES), ("format", formats, FORMATS)):
        for item in given:
            if item not in known:
                raise LmforgeError(f"unknown {name} {item!r}: use one or more of {', '.join(known)}")
    result = [Condition("free", "text")] if "free" in modes else []
    for mode in ("instructed", "constrained"):
        if mode in modes:
            result += [Condition(mode, fmt, order) for fmt in formats for order in ORDERS]
    if "converted" in modes:  # conversion restates a free reply: reasoning first, as it was written
        result += [Condition("converted", fmt) for fmt in formats]
    return result


@dataclass(frozen=True)
class Outcome:
    correct: bool
    parse_error: bool
    why: str = ""  # what was read, or why nothing could be


def _same(value, expected) -> bool:
    return str(value).strip().lower() == str(expected).strip().lower()


def score(task: Task, fmt: str, text: str, complete: bool = True) -> Outcome:
    """Read the answer in reply `text` (format `fmt`, "text" for free text) and compare it with the task's.

    `complete` False: constrained decoding ran out of tokens before the grammar closed."""
    if not complete:
        return Outcome(False, True, "cut by --max-new-tokens before the format closed")
    if fmt == "text":
        start = text.lower().rfind("the answer is")
        if start < 0:
            return Outcome(False, True, 'no "the answer is" in the reply')
        value = text[start + len("the answer is"):].split("\n")[0].strip().rstrip(".").strip()
        return Outcome(_same(value, task.answer), False, value)
    try:
        value = parse_answer(text, fmt)
    except ParseError as err:
        return Outcome(False, True, str(err))
    if not isinstance(value, dict) or "answer" not in value:
        return Outcome(False, True, "no answer key")
    return Outcome(_same(value["answer"], task.answer), False, str(value["answer"]))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (Wilson 1927): sound at 0 and n
    successes, where the normal approximation p ± z·sqrt(p(1-p)/n) collapses to a point."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0 and n successes the bounds are exactly 0 and 1; rounding would put them a hair inside.
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


@dataclass
class Row:
    """One cell of the study: a task kind (or a group of kinds) under one condition."""
    kinds: str
    condition: str
    n: int
    correct: int
    parse_errors: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def parse_error_rate(self) -> float:
        return self.parse_errors / self.n if self.n else 0.0


def summarize(records: list[dict]) -> list[Row]:
    """Rows per kind and condition, then per condition over the reasoning kinds and over the others.
    `records`: dicts with kind, condition (its label), correct, parse_error."""
    cells: dict[tuple[str, str], list[int]] = {}  # (kinds, condition) -> [n, correct, parse errors]
    for record in records:
        group = "reasoning" if record["kind"] in REASONING_KINDS else "other"
        for kinds in (record["kind"], f"all {group}"):
            cell = cells.setdefault((kinds, record["condition"]), [0, 0, 0])
            cell[0] += 1
            cell[1] += bool(record["correct"])
            cell[2] += bool(record["parse_error"])
    rank = {kind: index for index, kind in enumerate([*KINDS, "all reasoning", "all other"])}
    conditions_seen = list(dict.fromkeys(record["condition"] for record in records))
    order = sorted(cells, key=lambda key: (rank[key[0]], conditions_seen.index(key[1])))
    return [Row(kinds, condition, *cells[(kinds, condition)]) for kinds, condition in order]


def _rate(k: int, n: int) -> str:
    low, high = wilson(k, n)
    return f"{100 * k / n:5.1f}% [{100 * low:4.1f}, {100 * high:5.1f}]"


def table_markdown(rows: list[Row]) -> str:
    lines = ["| tasks | condition | n | accuracy [95% CI] | parse errors [95% CI] |", "|---|---|---:|---:|---:|"]
    lines += [f"| {row.kinds} | {row.condition} | {row.n} | {_rate(row.correct, row.n)} | "
              f"{_rate(row.parse_errors, row.n)} |" for row in rows]
    return "\n".join(lines) + "\n"


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name, justify in (("tasks", "left"), ("condition", "left"), ("n", "right"),
                          ("accuracy [95% CI]", "right"), ("parse errors [95% CI]", "right")):
        table.add_column(name, justify=justify)
    previous = None
    for row in rows:
        if previous is not None and row.kinds != previous:
            table.add_section()
        table.add_row(row.kinds if row.kinds != previous else "", row.condition, str(row.n),
                      _rate(row.correct, row.n), _rate(row.parse_errors, row.n))
        previous = row.kinds
    Console(width=120).print(table)


def plot_rows(rows: list[Row], path: Path, title: str) -> None:
    """One panel per task kind (and group): accuracy per condition with its interval, parse-error
    rate as a red tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(row.kinds for row in rows))
    labels = list(dict.fromkeys(row.condition for row in rows))
    columns = min(4, len(groups))
    lines = -(-len(groups) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 0.28 * len(labels) * lines + 1.5),
                             squeeze=False, sharey=True)
    colours = {"free": "tab:green", "converted": "tab:blue", "instructed": "tab:orange", "constrained": "tab:purple"}
    for ax, group in zip(axes.flat, groups):
        cells = {row.condition: row for row in rows if row.kinds == group}
        for y, label in enumerate(labels):
            row = cells.get(label)
            if row is None:
                continue
            low, high = wilson(row.correct, row.n)
            ax.barh(y, row.accuracy, color=colours[label.split()[0]], alpha=0.8)
            ax.errorbar(row.accuracy, y, xerr=[[row.accuracy - low], [high - row.accuracy]], color="black",
                        capsize=2, linewidth=0.8)
            ax.plot(row.parse_error_rate, y, marker="|", color="red", markersize=10)
        ax.set_title(f"{group} (n={next(iter(cells.values())).n})", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(f"{title}\nbars: accuracy with 95% Wilson interval; red tick: parse-error rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- running the study ------------------------------------------------------------------------


def study_plan(kinds: list[str], n: int, seed: int) -> list[Task]:
    """The test tasks of the study: `n` of each kind."""
    for kind in kinds:
        if kind not in KINDS:
            raise LmforgeError(f"unknown task kind {kind!r}: use one or more of {', '.join(KINDS)}")
    if n < 1:
        raise LmforgeError("--tasks must be >= 1")
    return [task for kind in kinds for task in make_tasks(kind, n, seed, split="test")]


RESULT_FILES = ("results.jsonl", "table.md", "summary.json", "results.png")  # what a study writes into --out


def _write_results(out: Path, records: list[dict], rows: list, title: str) -> None:
    """The study's files, RESULT_FILES, in folder `out`."""
    with open(out / "results.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    (out / "table.md").write_text(f"{title}\n\n{table_markdown(rows)}", encoding="utf-8")
    (out / "summary.json").write_text(json.dumps([{**asdict(row), "accuracy": row.accuracy,
                                                   "accuracy_ci": wilson(row.correct, row.n),
                                                   "parse_error_rate": row.parse_error_rate,
                                                   "parse_error_ci": wilson(row.parse_errors, row.n)}
                                                  for row in rows], indent=1), encoding="utf-8")
    plot_rows(rows, out / "results.png", title)


def run_study(model_path: str, tasks: list[Task], conds: list[Condition], out: Path, max_new_tokens: int = 160,
              device: str = "auto", progress: bool = True) -> list[Row]:
    """Answer every task under every condition; write results.jsonl, table.md, summary.json and
    results.png into `out`; return the rows."""
    from tqdm import tqdm

    from lmforge.parallel.world import resolve_device
    from lmforge.runs.load import load_model
    from lmforge.structured.constrain import Answerer

    # an lmforge run folder (its latest good checkpoint; a LoRA run as its base plus adapters) or a
    # Hugging Face folder, in fp32; its end_id (end-of-text, or an imported model's end-of-sequence) ends a reply
    loaded = load_model(model_path, "fp32", resolve_device(device, setting="--device"),
                        warn=lambda message: print(f"warning: {message}"))
    answerer = Answerer(loaded, max_new_tokens)
    records = []
    with tqdm(total=len(tasks) * len(conds), desc="eval-format", unit="reply", disable=not progress,
              dynamic_ncols=True) as bar:
        for task in tasks:
            if any(cond.mode in ("free", "converted") for cond in conds):  # one free reply serves both
                free = answerer.answer(prompt(task, "text"))
            for cond in conds:
                if cond.mode == "free":
                    text, complete = free
                elif cond.mode == "converted":
                    text, complete = answerer.answer(conversion_prompt(task, free[0], cond.fmt))
                else:  # instructed; constrained: the same prompt, decoded under the format's grammar
                    grammar = (task.answer_type, cond.fmt, cond.order) if cond.mode == "constrained" else None
                    text, complete = answerer.answer(prompt(task, cond.fmt, cond.order), grammar)
                outcome = score(task, cond.fmt, text, complete or cond.mode != "constrained")
                records.append({"kind": task.kind, "condition": cond.label, "mode": cond.mode, "format": cond.fmt,
                                "order": cond.order, "question": task.question, "expected": task.answer,
                                "reply": text, "complete": complete, **asdict(outcome)})
                bar.update()
    rows = summarize(records)
    title = f"lmforge eval-format {Path(model_path).name}: {len(tasks)} tasks, greedy, max {max_new_tokens} new tokens"
    write_staged(out, lambda folder: _write_results(folder, records, rows, title))  # all four files or none
    print_table(rows, title)
    return rows
