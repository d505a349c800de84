"""A model's special tokens and chat template, as the model defines them.

lmforge's own models know one special token, the end of a document (data.end_token). A model from
Hugging Face brings more, in files beside tokenizer.json (HF_TOKENIZER_FILES):
  - tokenizer_config.json: bos_token / eos_token, and `chat_template`, the Jinja template that
    turns a list of messages into the text the model was tuned on (transformers 5 writes the
    template to chat_template.jinja instead);
  - generation_config.json: `eos_token_id`, one id or a list (an instruct model ends a turn with
    <|eot_id|> and a document with <|end_of_text|>: either stops), and its sampling defaults.
lmforge keeps these files byte for byte with the tokenizer (a run folder's checkpoints hold them),
reads what it needs from them here, and writes them back on export, so what came in goes out.

A tokenizer's post-processor may put tokens around every text it encodes (Llama 3's adds
<|begin_of_text|> in front): `bos_ids` is what it puts in front. Text is encoded without it
(`encode_plain`), and a sequence gets it once, at its start.
"""

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.data.corpus import END_OF_TEXT

# beside tokenizer.json, copied as they are (the sampling defaults, the template, the token names)
HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "generation_config.json")


def json_object(files: dict[str, bytes], name: str) -> dict:
    """File `name` of `files` as a JSON object ({} if absent); one line if it is no JSON object."""
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LmforgeError(f"{name} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise LmforgeError(f"{name} holds a JSON {type(value).__name__}, expected an object of settings")
    return value


def _stop_ids(eos) -> list[int]:
    """generation_config.json's eos_token_id: one id, a list of them (any stops), or none."""
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise LmforgeError(f"generation_config.json: eos_token_id is {eos!r}, expected a token id or a list of them")
    return ids


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SAMPLING = {  # generation_config.json's sampling settings that chat takes as its defaults, and what each must be
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_k": (lambda v: _is_number(v) and v == int(v) >= 0, "an integer >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
}


def _sampling_defaults(generation: dict) -> dict:
    """The sampling settings of generation_config.json, checked as the CLI checks its options; a null
    one is unset, and top_k 0 is transformers' "no top-k" (None here)."""
    defaults = {}
    for key, (ok, what) in SAMPLING.items():
        value = generation.get(key)
        if value is None:
            continue
        if not ok(value):
            raise LmforgeError(f"generation_config.json: {key} is {value!r}, expected {what}")
        defaults[key] = (int(value) or None) if key == "top_k" else value
    return defaults


def _template(files: dict[str, bytes], config: dict) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (a string, or a list of
    named ones: the default)."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode(errors="replace")
    template = config.get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise LmforgeError(f"tokenizer_config.json: chat_template is {template!r:.40}, expected a Jinja template "
                           f"(a string) or a list of named ones")
    return template


def token_name(value) -> str | None:
    """A token as tokenizer_config.json names it: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s token ids, without the tokens a post-processor adds (special tokens written in the
    text, such as a chat template's headers, are still recognised)."""
    return tokenizer.encode(text, add_special_tokens=False).ids if text else []


def leading_special_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer's post-processor puts in front of every text (Llama 3: its BOS)."""
    encoding = tokenizer.encode("a")
    lead = []
    for token, special in zip(encoding.ids, encoding.special_tokens_mask):
        if not special:
            break
        lead.append(token)
    return tuple(lead)


@dataclass(frozen=True)
class SpecialTokens:
    """What a model's files say about its special tokens. `files`: the HF files it was read from,
    by name (empty for a model lmforge trained)."""
    end: str  # data.end_token: ends a document, pads examples
    end_id: int
    stop_ids: tuple[int, ...]  # every token that ends generation (end_id among them)
    bos_ids: tuple[int, ...]  # what starts a sequence (the post-processor's leading tokens)
    chat_template: str | None
    token_names: dict = field(default_factory=dict)  # bos_token, eos_token, ... for the template
    generation_defaults: dict = field(default_factory=dict)  # temperature, top_k, top_p of generation_config
    files: dict = field(default_factory=dict)

    def ends(self, ids: list[int]) -> bool:
        return bool(ids) and ids[-1] in self.stop_ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of `messages` under the model's chat template (transformers' apply_chat_template
        with tokenize=False renders the same)."""
        if self.chat_template is None:
            raise ValueError("the model has no chat template")
        return _render(self.chat_template, messages, add_generation_prompt, self.token_names)


def special_tokens(tokenizer: Tokenizer, end_token: str, files: dict[str, bytes] | None = None) -> SpecialTokens:
    """The special tokens of a model whose tokenizer is `tokenizer` and whose HF files (by name:
    HF_TOKENIZER_FILES) are `files`. Stops: `end_token` and generation_config.json's eos_token_id (any
    of a list), the tokens transformers' generate stops at."""
    files = {name: content for name, content in (files or {}).items() if name in HF_TOKENIZER_FILES}
    end_id = tokenizer.token_to_id(end_token)
    if end_id is None:
        raise LmforgeError(f"the tokenizer has no {end_token} token (data.end_token)")
    config, generation = json_object(files, "tokenizer_config.json"), json_object(files, "generation_config.json")
    named = {**json_object(files, "special_tokens_map.json"), **config}
    names = {key: token_name(value) for key, value in named.items()
             if key.endswith("_token") and token_name(value) is not None}
    stops = [end_id, *_stop_ids(generation.get("eos_token_id"))]
    template = _template(files, config)
    defaults = _sampling_defaults(generation)
    return SpecialTokens(end_token, end_id, tuple(dict.fromkeys(stops)), leading_special_ids(tokenizer),
                         template, names, defaults, files)


def _render(template: str, messages: list[dict], add_generation_prompt: bool, names: dict) -> str:
    """Render a chat template as transformers does: a sandboxed Jinja environment with trim_blocks
    and lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that keeps
    non-ASCII text."""
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **names)
    except TemplateError as err:
        raise LmforgeError(f"the model's chat template failed: {err}") from None


def load_special_tokens(folder: str | Path, tokenizer: Tokenizer, end_token: str = END_OF_TEXT) -> SpecialTokens:
    """The special tokens of the model whose tokenizer.json is in `folder` (a checkpoint): the
    Hugging Face files kept beside it, if any (above)."""
    folder = Path(folder)
    files = {name: (folder / name).read_bytes() for name in HF_TOKENIZER_FILES if (folder / name).is_file()}
    return special_tokens(tokenizer, end_token, files)
