import json
import re
import subprocess
import sys

import pytest
import torch

from lmforge.data.corpus import END_OF_TEXT, train_tokenizer
from lmforge.structured.constrain import format_grammar
from lmforge.structured.constrain import GrammarConstraint
from lmforge.structured.evaluate import Condition, conditions, score, summarize, table_markdown, wilson
from lmforge.structured.parse import parse_answer
from lmforge.structured.tasks import (CATEGORIES, KINDS, ORDERS, Task, make_tasks, prompt, reply, split_of,
                                      training_documents)
from tests.test_cli import lmforge

ADDITION = Task("addition", "What is 47 + 85?", "From the right, 7 + 5 = 12, write 2 carry 1.", 132)
LETTERS = Task("last_letters", 'Take the last letter of each word in "no on" and join them.', "r", "on")


@pytest.mark.parametrize("task, fmt, text, correct, parse_error", [
    (ADDITION, "text", "7 + 5 = 12. So the answer is 132.", True, False),
    (ADDITION, "text", "The answer is 131. Hmm, the answer is 132", True, False),  # the last one counts
    (ADDITION, "text", "So the answer is 131.", False, False),
    (ADDITION, "text", "7 + 5 = 12, write 2 carry 1. 132", False, True),  # no "the answer is"
    (ADDITION, "json", '{"reasoning": "r", "answer": 132}', True, False),
    (ADDITION, "json", 'Sure:\n```json\n{"answer": "132"}\n```', True, False),  # a string answer reads the same
    (ADDITION, "json", '{"reasoning": "r", "answer": 132.5}', False, False),
    (ADDITION, "json", '{"reasoning": "r", "answer": 132', False, True),  # unclosed
    (ADDITION, "json", '{"reasoning": "r", "result": 132}', False, True),  # no answer key
    (ADDITION, "json", "[132]", False, True),
    (ADDITION, "yaml", "reasoning: r\nanswer: 132", True, False),
    (ADDITION, "yaml", "answer: 132\nreasoning: 7 + 5 = 12: write 2", False, True),  # a second ": " breaks YAML
    (ADDITION, "xml", "<response><reasoning>r</reasoning><answer> 132 </answer></response>", True, False),
    (ADDITION, "xml", "<response><answer>132</answer>", False, True),
    (LETTERS, "yaml", "answer: 'on'", True, False),
    (LETTERS, "yaml", "answer: on", False, False),  # YAML 1.1 reads a bare `on` as true: a wrong answer
    (LETTERS, "text", "So the answer is ON.", True, False),  # case is ignored
])
def test_score_reads_hand_made_replies(task, fmt, text, correct, parse_error):
    outcome = score(task, fmt, text)
    assert (outcome.correct, outcome.parse_error) == (correct, parse_error), outcome.why


def test_a_cut_constrained_reply_is_a_parse_error_even_if_it_reads():
    assert score(ADDITION, "json", '{"answer": 132, "reasoning": "7 + 5', complete=False).parse_error


@pytest.mark.parametrize("k, n, low, high", [
    # Newcombe 1998 ("Two-sided confidence intervals for the single proportion"), Table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_interval_matches_published_values(k, n, low, high):
    assert wilson(k, n) == pytest.approx((low, high), abs=5e-5)


def test_wilson_interval_holds_the_rate_at_the_ends():
    for n in range(1, 60):
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0
        for k in range(n + 1):
            low, high = wilson(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0


def test_summary_counts_rates_and_intervals_by_hand():
    records = [{"kind": "addition", "condition": "free text", "correct": c, "parse_error": p}
               for c, p in [(True, False)] * 7 + [(False, False)] * 10 + [(False, True)] * 3]
    records += [{"kind": "counting", "condition": "free text", "correct": c, "parse_error": False}
                for c in [True] * 4 + [False]]
    records += [{"kind": "sentiment", "condition": "instructed json", "correct": True, "parse_error": False}] * 2
    rows = {(row.kinds, row.condition): row for row in summarize(records)}
    assert list(rows) == [("addition", "free text"), ("counting", "free text"), ("sentiment", "instructed json"),
                          ("all reasoning", "free text"), ("all other", "instructed json")]
    addition = rows[("addition", "free text")]
    assert (addition.n, addition.correct, addition.parse_errors) == (20, 7, 3)
    assert addition.accuracy == 0.35 and addition.parse_error_rate == 0.15
    pooled = rows[("all reasoning", "free text")]
    assert (pooled.n, pooled.correct, pooled.parse_errors) == (25, 11, 3)
    # 7/20 by hand: p = 0.35, z^2/n = 0.19208; centre (0.35 + 0.09604) / 1.19208 = 0.374169;
    # half 1.96 / 1.19208 * sqrt(0.35 * 0.65 / 20 + 3.8416 / 1600) = 0.192981
    assert wilson(7, 20) == pytest.approx((0.374169 - 0.192981, 0.374169 + 0.192981), abs=2e-6)
    assert "| addition | free text | 20 |  35.0% [18.1,  56.7] |  15.0% [ 5.2,  36.0] |" in table_markdown(
        list(rows.values()))


def _solve(task: Task):
    """The answer computed again from the question alone."""
    q = task.question
    if task.kind == "addition":
        a, b = map(int, re.findall(r"\d+", q))
        return a + b
    if task.kind == "last_letters":
        return "".join(word[-1] for word in re.search(r'"(.*)"', q).group(1).split())
    if task.kind == "counting":
        category = {f"{name}s": name for name in CATEGORIES}[q.split()[2]]
        return sum(word in CATEGORIES[category] for word in q.split("? ")[1].split(", "))
    if task.kind == "sentiment":
        return "positive" if any(w in q for w in ("great", "lovely", "superb", "wonderful", "excellent",
                                                  "pleasant", "delightful", "charming", "tasty", "friendly")) \
            else "negative"
    field, sentence = re.match(r"Which (\w+) does this sentence name\? (.*)", q).groups()
    pattern = {"person": r"\b([A-Z][a-z]+)\b(?! in)", "city": r"(?:to|in|from) ([A-Z][a-z]+)", "year": r"(\d{4})"}
    candidates = [w for w in re.findall(pattern[field], sentence) if w not in ("In", "The")]
    return candidates[0]


def test_task_generator_is_deterministic_with_exact_answers():
    for kind in KINDS:
        tasks = make_tasks(kind, 60, seed=3)
        assert tasks == make_tasks(kind, 60, seed=3)
        assert tasks != make_tasks(kind, 60, seed=4)
        assert len({task.question for task in tasks}) == 60
        for task in tasks:
            assert task.answer == _solve(task), task
            assert split_of(task.question) == "test"
        train = {task.question for task in make_tasks(kind, 300, seed=3, split="train")}
        assert not train & {task.question for task in tasks}
    addition = make_tasks("addition", 200, seed=0)
    assert all("carry 1" in task.reasoning for task in addition)
    # the same in another process (string seeds, not hash(), which changes per process)
    code = "from lmforge.structured.tasks import make_tasks; print([t.answer for t in make_tasks('counting', 30)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str([task.answer for task in make_tasks("counting", 30)])


def test_every_template_parses_back_to_the_answer_in_its_key_order():
    for kind in KINDS:
        for task in make_tasks(kind, 30, seed=1):
            assert score(task, "text", reply(task, "text")).correct
            for fmt in ("json", "yaml", "xml"):
                for order in ORDERS:
                    text = reply(task, fmt, order)
                    assert score(task, fmt, text).correct, text
                    keys = list(parse_answer(text, fmt))
                    assert keys == (["reasoning", "answer"] if order == "reasoning-first" else ["answer", "reasoning"])
                    assert f"{'reasoning' if order == 'reasoning-first' else 'answer'}" in prompt(task, fmt, order) \
                        .split("\n")[1].split(" then ")[0]


def test_training_documents_follow_the_mix():
    docs = training_documents(1000, seed=0)
    assert docs == training_documents(1000, seed=0)
    converted = sum("\nNow reply in" in doc for doc in docs)
    formatted = sum("Reply in plain text" not in doc for doc in docs)
    free = 1000 - converted - formatted
    assert 350 < free < 450 and 350 < formatted < 450 and 150 < converted < 250, (free, formatted, converted)
    test_questions = {task.question for kind in KINDS for task in make_tasks(kind, 50)}
    assert not any(doc.split("\n")[0].removeprefix("Question: ") in test_questions for doc in docs)


@pytest.mark.parametrize("fmt", ["json", "yaml", "xml"])
def test_constrained_replies_always_parse_with_the_keys_in_order(fmt):
    """Random walks through each grammar (a uniform choice among the tokens it allows, as an
    untrained model at a high temperature would make, without the model's cost): every reply the
    grammar closes parses, with its keys in the asked order."""
    import llguidance

    tokenizer = train_tokenizer(training_documents(500), 512)
    end = tokenizer.token_to_id(END_OF_TEXT)
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=end)
    generator = torch.Generator().manual_seed(0)
    complete = 0
    for walk in range(60):
        order, answer_type = ORDERS[walk % 2], ["integer", "string"][walk // 2 % 2]
        constraint = GrammarConstraint(llguidance.LLMatcher(ll_tokenizer, format_grammar(answer_type, fmt, order)))
        tokens = []
        while not constraint.finished() and len(tokens) < 400:
            allowed = constraint.allowed(tokenizer.get_vocab_size()).float()
            token = int(torch.multinomial(allowed, 1, generator=generator))
            constraint.consume(token)
            if token == end:
                break
            tokens.append(token)
        if not constraint.complete():
            continue
        complete += 1
        value = parse_answer(tokenizer.decode(tokens), fmt)
        assert list(value) == (["reasoning", "answer"] if order == "reasoning-first" else ["answer", "reasoning"])
        if fmt == "json" and answer_type == "integer":
            assert isinstance(value["answer"], int)
    assert complete >= 10, complete  # enough walks closed for the check to mean something


def test_conditions_and_unknown_names():
    conds = conditions(["free", "instructed", "constrained", "converted"], ["json", "yaml", "xml"])
    assert len(conds) == 1 + 6 + 6 + 3
    assert conds[0] == Condition("free", "text") and conds[-1].label == "converted xml"
    assert conditions(["instructed"], ["yaml"])[1].label == "instructed yaml answer-first"


@pytest.mark.parametrize("args, message", [
    (["--modes", "free,fancy"], "unknown mode 'fancy': use one or more of free, instructed, constrained, converted"),
    (["--formats", "json,toml"], "unknown format 'toml': use one or more of json, yaml, xml"),
    (["--kinds", "poetry"], "unknown task kind 'poetry': use one or more of last_letters, addition, counting, "
                            "sentiment, extraction"),
    ([], "runs/none does not exist: give an lmforge run folder (config.yaml, "
                  "checkpoints/) or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"),
])
def test_bad_eval_format_arguments_are_one_line_exit_2(tmp_path, args, message):
    result = lmforge("eval-format", "runs/none", *args, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, f"lmforge: error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_eval_format_end_to_end_on_a_tiny_run(tmp_path):
    result = lmforge("tasks", "--out", "tasks.jsonl", "-n", "600", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tasks.jsonl: 600 documents (40% text, 40% formatted, 20% converted), seed 0\n"
    lines = (tmp_path / "tasks.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == training_documents(600)
    result = lmforge("train", "--model", "tiny", "data.source=tasks.jsonl", "train.max_steps=2",
                     "train.eval_interval=2", "train.checkpoint_interval=2", "train.sample_tokens=0",
                     "train.batch_size=2", "--name", "t", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = lmforge("eval-format", "runs/t", "--tasks", "1", "--kinds", "addition,sentiment", "--max-new-tokens",
                     "12", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "runs" / "t" / "eval-format"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 16  # a task of each of two kinds under 16 conditions
    tasks = make_tasks("addition", 1) + make_tasks("sentiment", 1)
    assert [r["question"] for r in records[::16]] == [task.question for task in tasks]
    for record in records:  # each stored verdict is what score() says of the stored reply
        task = next(task for task in tasks if task.question == record["question"])
        complete = record["complete"] or record["mode"] != "constrained"
        outcome = score(task, record["format"], record["reply"], complete)
        assert (outcome.correct, outcome.parse_error) == (record["correct"], record["parse_error"])
    summary = json.loads((out / "summary.json").read_text())
    row = next(r for r in summary if r["kinds"] == "all reasoning" and r["condition"] == "constrained json")
    assert row["n"] == 1
    assert row["parse_errors"] == sum(r["parse_error"] for r in records
                                      if r["kind"] == "addition" and r["condition"] == "constrained json")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "constrained xml answer-first" in result.stdout and "all reasoning" in result.stdout
    table = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 * 16 + 2 * 16  # the header, then per kind and per group
