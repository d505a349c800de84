"""Getting replies for eval-format: load a model once (one function), decode greedily, with or
without a grammar."""

import llguidance

from lmforge.common.errors import LmforgeError
from lmforge.generate.sampling import generate
from lmforge.runs.load import LoadedModel
from lmforge.runs.load import load_model as load_folder
from lmforge.structured.constrain import GrammarConstraint, json_grammar


def load_model(path: str, device: str = "auto") -> LoadedModel:
    """The model in `path`, evaluation-ready, in fp32: an lmforge run folder (its latest good
    checkpoint; a LoRA run as its base plus adapters) or a local Hugging Face Llama / GPT-2 folder,
    read by the one loader, lmforge/runs/load.py. Its `end_id` ends a reply: lmforge's end-of-text,
    or an imported model's end-of-sequence."""
    from lmforge.parallel.world import resolve_device

    target = resolve_device(device, setting="--device")
    return load_folder(path, "fp32", target, warn=lambda message: print(f"warning: {message}"))


# Fixed-key YAML and XML as Lark grammars (llguidance has no general YAML or XML grammar). A YAML
# value is one line that starts with a letter or digit and holds no `:` or `#` (either could end a
# plain scalar early), or a single-quoted string; XML text has no `<` or `&`. Neither may hold the
# control characters their parsers refuse, nor (YAML) a tab or the other line breaks, \r, NEL, LS, PS.
# Both therefore always parse.
_YAML_CHAR = r"[^\n\r\t:#'\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ufffe\uffff]"
_YAML_VALUE = rf"""VALUE: /[A-Za-z0-9]{_YAML_CHAR}*/ | /'{_YAML_CHAR.replace(":#", "")}*'/"""
_XML_TEXT = r"""TEXT: /[^<&\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]*/"""


def format_grammar(answer_type: str, fmt: str, order: str) -> str:
    """The llguidance grammar of a reply in `fmt` with the keys reasoning and answer in `order`
    (JSON: a schema with the answer's type, `integer` or `string`)."""
    keys = ("reasoning", "answer") if order == "reasoning-first" else ("answer", "reasoning")
    if fmt == "json":
        types = {"reasoning": "string", "answer": answer_type}
        return json_grammar({"type": "object", "properties": {key: {"type": types[key]} for key in keys},
                             "required": list(keys), "additionalProperties": False})
    if fmt == "yaml":
        lark = f'start: "{keys[0]}: " VALUE "\\n{keys[1]}: " VALUE\n{_YAML_VALUE}\n'
    elif fmt == "xml":
        lark = (f'start: "<response><{keys[0]}>" TEXT "</{keys[0]}><{keys[1]}>" TEXT "</{keys[1]}></response>"\n'
                f"{_XML_TEXT}\n")
    else:
        raise LmforgeError(f"no grammar for format {fmt!r}")
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Answerer:
    """Greedy replies of one model to prompts, each at most `max_new_tokens` long."""

    def __init__(self, loaded: LoadedModel, max_new_tokens: int):
        self.loaded, self.max_new_tokens = loaded, max_new_tokens
        # The vocabulary is read once (~20 ms at 4096 tokens), the grammars compiled once each.
        self.ll_tokenizer = llguidance.LLTokenizer(loaded.tokenizer.to_str(), eos_token=loaded.end_id)
        self.grammars: dict[tuple, str] = {}

    def answer(self, prompt: str, grammar: tuple[str, str, str] | None = None) -> tuple[str, bool]:
        """The reply to `prompt` and whether it ended by itself (False: cut by max_new_tokens, or, under
        `grammar` = (answer_type, fmt, order), stopped before the grammar closed)."""
        loaded = self.loaded
        constraint = None
        if grammar is not None:
            if grammar not in self.grammars:
                self.grammars[grammar] = format_grammar(*grammar)
            constraint = GrammarConstraint(llguidance.LLMatcher(self.ll_tokenizer, self.grammars[grammar]))
        tokens = generate(loaded.model, loaded.tokenizer.encode(prompt).ids, self.max_new_tokens, temperature=0,
                          stop_token=loaded.end_id, constraint=constraint)
        text = loaded.tokenizer.decode(tokens)
        complete = constraint.complete() if constraint is not None else len(tokens) < self.max_new_tokens
        return text, complete
