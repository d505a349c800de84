"""Grammar-constrained decoding ("JSON mode"): only tokens that keep the answer valid may be sampled.

The grammar engine is llguidance (guidance-ai, MIT, Rust with Python bindings). Measured here
(2026-11-30, this CPU, offline, against lmforge's byte-level BPE tokenizer.json):
- llguidance 1.9.1 installs alone (no dependencies), reads the tokenizer straight from its JSON
  (`LLTokenizer(tokenizer.to_str())`, byte-level decoding handled, any HF tokenizers file such as
  an imported model's works the same way), and compiles JSON Schema into a context-free grammar,
  so nesting depth is unbounded. It also takes Lark grammars, the way to add formats later.
- outlines-core 0.2.14 installs alone too, but compiles a schema to a regular expression (a
  free-form object's nesting is bounded by the expression), and its Vocabulary is either built by
  the caller from token strings, byte-level mapping included, or downloaded from the Hub (offline
  here).
- xgrammar 0.2.9 pulls transformers, pydantic and apache-tvm-ffi, and an unpinned triton next to
  the 3.7.1 that torch's CUDA wheels pin.
So llguidance. It has built-in grammars for JSON and JSON Schema only: YAML and XML would need
grammars written by hand (and XML's matching end tags are not context-free for free tag names),
so constrained decoding is offered for JSON; YAML and XML answers are parsed (parse.py) instead.
Only `lmforge eval-format` decodes YAML and XML under a grammar: fixed-key Lark grammars of its
two keys (format_grammar), in its greedy replies (Answerer).

The mask concerns the tokens generated, not the prompt, so it composes with lmforge's sampler
(temperature, top-k, top-p are applied to the surviving logits) and its KV cache. What it cannot
do is make an answer end in time: when max_new_tokens runs out first, the answer is reported as
cut (ConstrainedOutput.complete is False) rather than closed by force, since a forced close turns a
half-written value (`{"answer": "12`) into a different answer that parses and validates.
"""

import functools
import json
from dataclasses import dataclass

import jsonschema
import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.generate.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.runs.load import LoadedModel
from lmforge.structured.parse import check_schema, parse_answer

CONSTRAINED_FORMATS = ("json",)
# One layout, json.dumps's (`{"a": 1, "b": [2, 3]}`), the commonest in training text: free
# whitespace would let an unsure model spend its whole budget on spaces and newlines.
_COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict | None) -> str:
    """The llguidance grammar for JSON matching `schema` (any JSON object when None).

    LmforgeError if the schema is not a valid JSON Schema or uses what llguidance cannot compile."""
    if schema is None:
        schema = {"type": "object"}
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as err:
        where = "".join(f"[{p!r}]" for p in err.absolute_path) or "the top level"
        raise LmforgeError(f"the schema is not a valid JSON Schema at {where}: {err.message.splitlines()[0]}") from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPILE_OPTIONS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        why = " ".join(line.strip() for line in messages[0].splitlines())  # regex errors span lines
        raise LmforgeError(f"the schema cannot be used for constrained decoding: {why}")
    return grammar


def load_schema(path: str) -> dict:
    """The JSON Schema in file `path`; LmforgeError naming the problem if unreadable."""
    try:
        with open(path, encoding="utf-8") as file:
            schema = json.load(file)
    except FileNotFoundError:
        raise LmforgeError(f"schema file {path} not found") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise LmforgeError(f"schema file {path} is not JSON ({err})") from None
    if not isinstance(schema, dict):
        raise LmforgeError(f"schema file {path} holds a {type(schema).__name__}, not a JSON Schema object")
    return schema


class GrammarConstraint:
    """The `constraint` of sampling.generate(): an llguidance matcher over one answer's tokens."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self._check()

    def _check(self):
        if self.matcher.is_error():
            raise LmforgeError(f"constrained decoding failed: {self.matcher.get_error().splitlines()[0]}")

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Boolean mask (vocab_size,): True for tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        # Ids past the tokenizer's vocabulary (a model padded to a round size) are never allowed.
        n = min(vocab_size, len(bits))
        mask[:n] = torch.from_numpy(bits[:n].astype(bool))
        self._check()
        return mask

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        self._check()

    def finished(self) -> bool:
        """True once nothing but the stop token may follow (the answer is closed)."""
        return self.matcher.is_stopped()

    def complete(self) -> bool:
        return self.matcher.is_accepting()


@dataclass
class ConstrainedOutput:
    text: str
    tokens: list[int]
    complete: bool  # False: max_new_tokens ran out before the answer closed (the text does not parse)
    value: object = None  # the parsed answer when complete


class JsonMode:
    """JSON answers (matching `schema` when given) for one tokenizer, set up once for many answers.

    `grammar`: json_grammar(schema) when already compiled (the CLI checks the schema first)."""

    def __init__(self, tokenizer: Tokenizer, stop_token: int, schema: dict | None = None, grammar: str | None = None):
        self.tokenizer, self.stop_token, self.schema = tokenizer, stop_token, schema
        self.grammar = grammar or json_grammar(schema)
        # Reading the vocabulary costs ~20 ms at 4096 tokens: once, not per answer.
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=stop_token)

    def constraint(self) -> GrammarConstraint:
        """A fresh constraint, for one answer."""
        return GrammarConstraint(llguidance.LLMatcher(self.ll_tokenizer, self.grammar))

    def generate(self, model: Transformer, prompt: list[int], max_new_tokens: int, **sampling) -> ConstrainedOutput:
        """A JSON answer continuing `prompt`. `sampling`: generate()'s keywords (temperature, seed...)."""
        constraint = self.constraint()
        tokens = generate(model, prompt, max_new_tokens, stop_token=self.stop_token, constraint=constraint,
                          **sampling)
        text = self.tokenizer.decode(tokens)
        if not constraint.complete():
            return ConstrainedOutput(text, tokens, complete=False)
        # The grammar already guarantees both; checking again costs little and catches an engine
        # that accepts more than the schema allows (JSON Schema keywords it does not enforce).
        value = parse_answer(text, "json")
        if self.schema is not None:
            check_schema(value, self.schema)
        return ConstrainedOutput(text, tokens, complete=True, value=value)


# Fixed-key YAML and XML as Lark grammars (llguidance has no general YAML or XML grammar). A YAML
# value is one line that starts with a letter or digit and holds no `:` or `#` (either could end a
# plain scalar early), or a single-quoted string; XML text has no `<` or `&`. Neither may hold the
# control characters their parsers refuse, nor (YAML) a tab or the other line breaks, \r, NEL, LS, PS.
# Both therefore always parse.
_YAML_CHAR = r"[^\n\r\t:#'\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ufffe\uffff]"
_YAML_VALUE = rf"""VALUE: /[A-Za-z0-9]{_YAML_CHAR}*/ | /'{_YAML_CHAR.replace(":#", "")}*'/"""
_XML_TEXT = r"""TEXT: /[^<&\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]*/"""


@functools.cache
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
    """eval-format's replies: greedy, each at most `max_new_tokens` long, from one model (runs/load.py's)."""

    def __init__(self, loaded: LoadedModel, max_new_tokens: int):
        self.loaded, self.max_new_tokens = loaded, max_new_tokens
        # The vocabulary is read once (~20 ms at 4096 tokens); format_grammar compiles each grammar once.
        self.ll_tokenizer = llguidance.LLTokenizer(loaded.tokenizer.to_str(), eos_token=loaded.end_id)

    def answer(self, prompt: str, grammar: tuple[str, str, str] | None = None) -> tuple[str, bool]:
        """The reply to `prompt` and whether it ended by itself (False: cut by max_new_tokens, or, under
        `grammar` = (answer_type, fmt, order), stopped before the grammar closed)."""
        loaded = self.loaded
        constraint = None
        if grammar is not None:
            constraint = GrammarConstraint(llguidance.LLMatcher(self.ll_tokenizer, format_grammar(*grammar)))
        tokens = generate(loaded.model, loaded.tokenizer.encode(prompt).ids, self.max_new_tokens, temperature=0,
                          stop_token=loaded.end_id, constraint=constraint)
        text = loaded.tokenizer.decode(tokens)
        complete = constraint.complete() if constraint is not None else len(tokens) < self.max_new_tokens
        return text, complete
