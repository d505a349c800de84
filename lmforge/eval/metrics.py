"""What a task's scores become: accuracies, bits per byte and the centered aggregate.

- acc: the fraction of questions whose gold choice has the highest summed log-probability.
- acc_norm: the same with each log-probability divided by its choice's length in characters (the
  continuation less its leading space, i.e. the choice text), lm-eval's `acc_norm`; OLMES calls
  it acc_per_char. For ASCII answers characters are bytes.
- acc_token: divided by its number of tokens instead (tokenizer-dependent; OLMES's acc_per_token).
- bpb: bits per byte of the gold continuation, -log p(gold | context) / (ln 2 * UTF-8 bytes of
  gold), averaged over questions (OLMo's in-loop metric, Groeneveld et al. 2024): it moves with the
  model long before accuracy leaves chance.
- centered: (acc - chance) / (1 - chance), chance the mean of 1 / number of choices; 0 is guessing
  and 1 is perfect. The aggregate is its mean over tasks (DCLM's CORE, Li et al. 2024, section 3.5,
  centers its tasks the same way); a generation task's chance is 0.
- pass@k (generation tasks): the unbiased estimate of Chen et al. 2021 from each prompt's n
  completions, averaged over prompts; a generation task's acc is its pass@1.
"""

import math

from lmforge.eval.score import Scored


def choice_chars(continuation: str) -> int:
    return max(1, len(continuation[1:] if continuation.startswith(" ") else continuation))


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def question_row(scored: list[Scored], continuations: list[str], gold: int) -> dict:
    """One question's results: its log-probabilities and which choice each rule picks."""
    lls = [s.logprob for s in scored]
    by_chars = [ll / choice_chars(c) for ll, c in zip(lls, continuations)]
    by_tokens = [s.logprob / s.tokens for s in scored]
    gold_bytes = len(continuations[gold].encode("utf-8"))
    return {"logprobs": lls, "gold": gold, "acc": argmax(lls) == gold, "acc_norm": argmax(by_chars) == gold,
            "acc_token": argmax(by_tokens) == gold, "bpb": -lls[gold] / (math.log(2) * max(1, gold_bytes)),
            "chance": 1 / len(lls)}


def summarise(rows: list[dict], truncated: int) -> dict:
    """A task's means over its questions (see the module docstring)."""
    n = len(rows)
    keys = ("acc", "acc_norm", "acc_token", "bpb", "chance", *(k for k in rows[0] if k.startswith("pass@")))
    out = {key: sum(float(r[key]) for r in rows) / n for key in keys if all(key in r for r in rows)}
    chance = out.get("chance", 0.0)
    out["centered"] = (out["acc"] - chance) / (1 - chance)
    out.update(items=n, truncated=truncated)
    return out


def aggregate(results: dict[str, dict]) -> float:
    """The CORE-style aggregate: the mean centered accuracy over tasks."""
    return sum(r["centered"] for r in results.values()) / len(results)


def table(results: dict[str, dict], titles: dict[str, str]) -> str:
    """The printed table: one line per task, then the aggregate."""
    lines = [f"{'task':<16}{'items':>6}{'acc':>8}{'acc_norm':>10}{'acc_tok':>9}{'bpb':>8}{'centered':>10}"
             f"{'truncated':>11}"]
    for task, r in results.items():
        cells = [f"{r[k]:.4f}" if k in r else "-" for k in ("acc", "acc_norm", "acc_token", "bpb", "centered")]
        lines.append(f"{titles.get(task, task):<16}{r['items']:>6}{cells[0]:>8}{cells[1]:>10}{cells[2]:>9}"
                     f"{cells[3]:>8}{cells[4]:>10}{r['truncated']:>11}")
    for task, r in results.items():  # sampled generations: pass@k beside acc (= pass@1)
        passes = [f"{k} {v:.4f}" for k, v in r.items() if k.startswith("pass@") and k != "pass@1"]
        if passes:
            lines.append(f"{titles.get(task, task)}: {', '.join(passes)}")
    lines.append(f"CORE-style centered aggregate over {len(results)} task(s): {aggregate(results):.4f}")
    return "\n".join(lines)
