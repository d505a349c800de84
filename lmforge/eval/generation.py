"""Generation tasks: greedy or sampled decoding until a stop sequence, then the answer checked.

Decoding is generate/sampling.py's `generate_batch` (the loop `generate` and `chat` run; temperature
0: greedy), many prompts at once, each row stopped at its task's stop sequences through its own
`constraint`: `StopAt` allows every token and declares the row finished once its decoded text holds
a stop sequence (or its token budget is spent); the text is then cut before it.

GSM8K (Cobbe et al. 2021): the number after "the answer is" (the few-shot examples' format), else
the last number of the text, compared by exact match with the reference after OLMES's normalisation
(commas, "$", a trailing "." removed). HumanEval (Chen et al. 2021) and MBPP (Austin et al. 2021):
the program (prompt + completion + the task's tests) runs in sandbox.py; pass@1 from one greedy sample,
or pass@k by Chen et al.'s unbiased estimator from n sampled ones (`Sampling`).
"""

import re
from dataclasses import dataclass

from lmforge.eval.sandbox import run_program
from lmforge.eval.tasks import Prompt
from lmforge.generate.sampling import generate_batch

NUMBER = r"-?[\d,]*\.?\d+"


class StopAt:
    """A `generate` constraint that restricts nothing and finishes at any of `stops` in the text, or
    after `limit` tokens (a row's own budget in a batch that decodes up to the largest)."""

    def __init__(self, tokenizer, stops: list[str], limit: int):
        self.tokenizer, self.stops, self.limit, self.ids = tokenizer, stops, limit, []

    def allowed(self, vocab_size: int) -> None:
        return None

    def consume(self, token: int) -> None:
        self.ids.append(token)

    def finished(self) -> bool:
        if len(self.ids) >= self.limit:
            return True
        text = self.tokenizer.decode(self.ids)
        return any(stop in text for stop in self.stops)


@dataclass(frozen=True)
class Sampling:
    """How a generation task decodes: `samples` completions per prompt, greedy (temperature 0) or drawn
    at `temperature` from the top-p nucleus (Chen et al. 2021 drew HumanEval's at 0.2 for pass@1 and
    0.8 for pass@100, top-p 0.95); the draws are seeded, so a run repeats."""
    samples: int = 1
    temperature: float = 0.0
    top_p: float | None = None
    seed: int = 0


def complete(model, tokenizer, prompts: list[Prompt], stop_ids, max_new_tokens: int | None = None,
             sampling: Sampling = Sampling()) -> list[tuple[str, bool]]:
    """Each prompt's continuation, decoded in one batch (greedy unless `sampling` says otherwise), cut
    at its first stop sequence (or a stop token of the model's, `stop_ids`), and whether the prompt
    had to be truncated (it filled the model's positions: generation keeps the latest of them)."""
    ids = [tokenizer.encode(p.context).ids for p in prompts]
    limits = [max_new_tokens or p.max_new_tokens for p in prompts]
    new = generate_batch(model, ids, max(limits), temperature=sampling.temperature, top_p=sampling.top_p,
                         seed=sampling.seed, stop_token=stop_ids,
                         constraints=[StopAt(tokenizer, p.stops, n) for p, n in zip(prompts, limits)])
    out = []
    for p, prompt_ids, tokens in zip(prompts, ids, new):
        text = tokenizer.decode(tokens)
        cut = min((text.index(s) for s in p.stops if s in text), default=len(text))
        out.append((text[:cut], len(prompt_ids) >= model.cfg.max_seq_len))
    return out


def normalise(answer: str) -> str:
    """OLMES's GSM8K normalisation: commas, dollar signs and a trailing period removed."""
    return re.sub(r"\.$", "", answer.replace(",", "").replace("$", "").strip())


def gsm8k_answer(text: str) -> str:
    """The model's answer: after "the answer is", else the last number; "" if there is none."""
    stated = re.findall(rf"answer is \$?({NUMBER})", text, flags=re.IGNORECASE)
    numbers = stated or re.findall(NUMBER, text)
    return normalise(numbers[-1]) if numbers else ""


def gsm8k_correct(text: str, doc: dict) -> bool:
    reference = doc.get("short_answer") or str(doc.get("label") or "")
    return gsm8k_answer(text) == normalise(reference)


def code_program(task: str, completion: str, doc: dict) -> str:
    """The program that passes when `completion` solves the task: HumanEval's prompt, the body and
    check(entry_point); MBPP's script followed by its setup and asserts."""
    if task == "codex_humaneval":
        return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"
    tests = "\n".join(doc.get("test_list", []))
    return f"{completion}\n\n{doc.get('test_setup_code', '')}\n{tests}\n"


def judge(task: str, completion: str, doc: dict) -> bool:
    """Whether a completion is right: exact match for GSM8K, the tests passed in the sandbox for code."""
    if task == "gsm8k":
        return gsm8k_correct(completion, doc)
    return run_program(code_program(task, completion, doc)).passed
