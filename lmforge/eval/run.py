"""`lmforge eval`: the tasks asked for, scored on one loaded model; results as a table, eval.json
and eval.png. A Ctrl-C keeps the tasks finished so far (and the items of the one under way)."""

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from lmforge.eval.generation import Sampling, complete, judge
from lmforge.eval.metrics import aggregate, question_row, summarise
from lmforge.eval.score import score_questions
from lmforge.eval.tasks import GENERATION, TITLES, load_prompts, load_questions
from lmforge.eval.sandbox import pass_at_k


CHUNK = 256  # questions scored in one call (sorted and batched inside it); a Ctrl-C keeps the chunks finished
# completions decoded in one batch (generate_batch), likewise; its KV cache holds GENERATION_CHUNK rows of
# the longest prompt plus --max-new-tokens positions
GENERATION_CHUNK = 16
PASS_K = (1, 10, 100)  # the k of Chen et al. 2021's table 1


def multiple_choice(model, tokenizer, end_id: int, questions, rows: list[dict]) -> int:
    """Each question's row appended to `rows` (kept on a Ctrl-C), CHUNK questions at a time; the number truncated."""
    truncated = 0
    for at in range(0, len(questions), CHUNK):
        chunk = questions[at:at + CHUNK]
        for q, (scored, cut) in zip(chunk, score_questions(model, tokenizer, [(q.contexts, q.continuations)
                                                                              for q in chunk], end_id)):
            rows.append(question_row(scored, q.continuations, q.gold))
            truncated += cut
    return truncated


def generation(model, tokenizer, end_id: int, stop_ids, task: str, prompts, max_new_tokens, rows: list[dict],
               sampling: Sampling = Sampling()) -> int:
    """Each prompt's `sampling.samples` completions judged, and the gold continuation's bits per byte,
    appended to `rows`, GENERATION_CHUNK completions decoded together at a time; the number truncated.
    acc is the fraction of a prompt's completions that are right, pass@k Chen et al.'s unbiased
    estimate for each k in PASS_K up to the samples."""
    truncated, n = 0, sampling.samples
    per_call = max(1, GENERATION_CHUNK // n)
    for at in range(0, len(prompts), per_call):
        chunk = prompts[at:at + per_call]
        wanted, completions = [p for p in chunk for _ in range(n)], []
        for start in range(0, len(wanted), GENERATION_CHUNK):  # each call its own seed: repeatable draws
            drawn = dataclasses.replace(sampling, seed=sampling.seed + at * n + start)
            completions += complete(model, tokenizer, wanted[start:start + GENERATION_CHUNK], stop_ids,
                                    max_new_tokens, drawn)
        golds = score_questions(model, tokenizer, [([p.context], [p.gold]) for p in chunk], end_id)
        for i, (p, ([gold], _)) in enumerate(zip(chunk, golds)):
            texts = [text for text, _ in completions[i * n:(i + 1) * n]]
            passed = [judge(task, text, p.doc) for text in texts]
            row = {"acc": sum(passed) / n, "chance": 0.0, "completion": texts[0],
                   "bpb": -gold.logprob / (math.log(2) * max(1, len(p.gold.encode("utf-8"))))}
            row.update({f"pass@{k}": pass_at_k(n, sum(passed), k) for k in PASS_K if k <= n})
            if n > 1:
                row.update(completions=texts, passed=passed)
            rows.append(row)
            truncated += completions[i * n][1]
    return truncated


def evaluate(loaded, tasks: list[str], fmt: str = "rc", shots: int | None = None, limit: int | None = None,
             max_new_tokens: int | None = None, stop_ids=None, log=print, sampling: Sampling = Sampling()) -> dict:
    """Every task's summary (metrics.summarise) and per-item rows, in task order. `stop_ids`: the
    tokens that end a generation (the model's, data/special_tokens.py; default its end of text)."""
    model, tokenizer, end_id = loaded.model, loaded.tokenizer, loaded.end_id
    results = {}
    for task in tasks:
        start, rows, truncated = time.perf_counter(), [], 0
        try:
            if task in GENERATION:
                truncated = generation(model, tokenizer, end_id, stop_ids or (end_id,), task,
                                       load_prompts(task, shots, limit), max_new_tokens, rows, sampling)
            else:
                questions = load_questions(task, fmt, shots, limit)
                truncated = multiple_choice(model, tokenizer, end_id, questions, rows)
        except KeyboardInterrupt:
            if rows:  # the items finished so far count; the tasks after it are not started
                results[task] = {**summarise(rows, truncated), "seconds": time.perf_counter() - start, "rows": rows}
            if not results:
                raise
            break
        results[task] = {**summarise(rows, truncated), "seconds": time.perf_counter() - start, "rows": rows}
        log(f"{TITLES[task]}: {len(rows)} items in {results[task]['seconds']:.1f} s", file=sys.stderr)
    return results


def write_results(results: dict, out: Path, settings: dict) -> tuple[Path, Path]:
    """eval.json (summaries, settings and per-item rows) and eval.png (centered accuracy and bpb per task)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    summary = {task: {k: v for k, v in r.items() if k != "rows"} for task, r in results.items()}
    report = {"settings": settings, "aggregate_centered": aggregate(results), "tasks": summary,
              "items": {task: r["rows"] for task, r in results.items()}}
    json_path, png_path = out / "eval.json", out / "eval.png"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(json_path)
    names = [TITLES[t] for t in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 2))
    left.barh(names, [r["centered"] for r in summary.values()], color="tab:blue")
    left.axvline(0, color="gray", lw=0.8)
    left.set_xlabel("centered accuracy (acc - chance) / (1 - chance)")
    right.barh(names, [r["bpb"] for r in summary.values()], color="tab:orange")
    right.set_xlabel("bits per byte of the gold answer")
    right.set_yticks([])
    fig.suptitle(f"{settings.get('model', '')}: aggregate {report['aggregate_centered']:.3f}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
