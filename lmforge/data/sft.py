"""Supervised fine-tuning data: examples whose loss is taken on the response tokens only.

A `.jsonl` file holds one example per line, either

    {"prompt": "...", "response": "..."}        the text is prompt + response, as given
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

Chat messages are rendered with the model's own chat template (data/special_tokens.py: the
Jinja `chat_template` of its tokenizer_config.json), as transformers' apply_chat_template renders
them, and the whole text is tokenized at once; the tokens of each assistant turn (its content and
the template's end of turn, <|eot_id|> for Llama 3) are trained. A model without a template (one
lmforge trained) gets a plain one, one header line per message:

    <|user|>\n{content}\n<|assistant|>\n{content}\n ... <|endoftext|>

(the headers are ordinary text to the tokenizer, not special tokens); to ask such a model, end the
prompt with "<|assistant|>\n". Prompt and response, and the plain template's parts, are each
tokenized by themselves without the special tokens a tokenizer's post-processor adds, so the
boundary between what is trained and what is not falls between tokens; the sequence starts with
the model's BOS once, if its tokenizer adds one (as `generate --prompt` encodes a prompt).

An example that does not end with one of the model's stop tokens gets its end-of-text token. The
model learns to produce the responses (every assistant turn, and the stop token after the last one:
it learns to stop), not the prompts: the target of every other position is IGNORE_INDEX, which
cross-entropy leaves out of its mean. So the loss of a step is the mean over its response tokens,
all micro-batches and ranks together (the engine weighs each micro-batch by its count of them:
parallel/engine.py, loss_divisors).

Padded, not packed: each example is one row of train.seq_len + 1 tokens, cut at the end if longer
and padded with end-of-text tokens (targets IGNORE_INDEX) if shorter. The model has no attention
mask between documents, so packing several examples into a row would let a response attend to an
unrelated earlier example, which it never sees at generation time; padding keeps each example
alone, at the price of computing on the padding: set train.seq_len near the longest example.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.data.corpus import END_OF_TEXT, Document, check_listed_once, read_text, split_documents
from lmforge.data.special_tokens import SpecialTokens, encode_plain, special_tokens
from lmforge.data.prepare import unigram_entropy
from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import IGNORE_INDEX

ROLES = ("system", "user", "assistant")


def chat_header(role: str) -> str:
    return f"<|{role}|>\n"


def check_messages(record: dict, where: str) -> list[dict]:
    """The record's "messages", checked: roles and string contents, the assistant's last."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise LmforgeError(f'{where}: "messages" must be a non-empty list')
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise LmforgeError(f"{where}: message {index + 1} must be {{\"role\": one of {', '.join(ROLES)}, "
                               f"\"content\": a string}}")
    if messages[-1]["role"] != "assistant":
        raise LmforgeError(f"{where}: the last message must be the assistant's (the response to learn)")
    return messages


def example_parts(record, where: str) -> list[tuple[str, bool]]:
    """An example record as (text, trained) parts, in order, under lmforge's plain chat template."""
    if not isinstance(record, dict):
        raise LmforgeError(f'{where} must be an object with "prompt" and "response", or "messages"')
    if "messages" in record:
        parts = []
        for message in check_messages(record, where):
            parts += [(chat_header(message["role"]), False),
                      (message["content"] + "\n", message["role"] == "assistant")]
        return parts
    if not isinstance(record.get("prompt"), str) or not isinstance(record.get("response"), str):
        raise LmforgeError(f'{where} must have "prompt" and "response" strings, or "messages"')
    if not record["response"]:
        raise LmforgeError(f"{where}: the response is empty: there is nothing to learn from it")
    return [(record["prompt"], False), (record["response"], True)]


def encode_example(tokenizer, parts: list[tuple[str, bool]], end_token: str = END_OF_TEXT,
                   special: SpecialTokens | None = None) -> tuple[list[int], list[bool]]:
    """The model's leading tokens (its BOS, if its tokenizer adds one), the parts' token ids with
    no special tokens between them, then `end_token` unless the last part ends with a stop token;
    and whether each token is trained (a target)."""
    special = special or special_tokens(tokenizer, end_token)
    ids, trained = list(special.bos_ids), [False] * len(special.bos_ids)
    for text, train in parts:
        part = encode_plain(tokenizer, text)
        ids += part
        trained += [train] * len(part)
    if not special.ends(ids):
        ids, trained = ids + [special.end_id], trained + [True]
    return ids, trained


def encode_chat(tokenizer, special: SpecialTokens, messages: list[dict],
                where: str) -> tuple[list[int], list[bool], int]:
    """A conversation under the model's own chat template: the token ids of the rendered text (what
    transformers' apply_chat_template(tokenize=True) gives), whether each is trained, and the bytes
    trained. Assistant turn i is the text between the conversation up to it with the generation
    prompt and the conversation including it: its content and the template's end of turn."""
    text = special.render_chat(messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = special.render_chat(messages[:index], add_generation_prompt=True) if index else ""
        through = special.render_chat(messages[:index + 1])
        if not through.startswith(before) or not text.startswith(through):
            raise LmforgeError(f"{where}: the model's chat template does not render the conversation as its "
                               f"beginning followed by each turn, so the assistant's turns cannot be told apart")
        spans.append((len(before), len(through)))
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = list(encoding.ids)
    trained = [any(start < span_end and span_start < end for span_start, span_end in spans)
               for start, end in encoding.offsets]
    if not special.ends(ids):
        ids, trained = ids + [special.end_id], trained + [True]
    return ids, trained, sum(len(text[start:end].encode()) for start, end in spans)


def encode_record(tokenizer, record, where: str, special: SpecialTokens) -> tuple[list[int], list[bool], int]:
    """An example record's token ids, trained flags and trained bytes: "messages" under the model's
    chat template (lmforge's plain one if it has none), prompt and response as given."""
    if isinstance(record, dict) and "messages" in record and special.chat_template is not None:
        return encode_chat(tokenizer, special, check_messages(record, where), where)
    parts = example_parts(record, where)
    ids, trained = encode_example(tokenizer, parts, special=special)
    return ids, trained, sum(len(text.encode()) for text, train in parts if train)


@dataclass
class ExampleSet:
    """Padded examples: `tokens` (n, seq_len + 1) and `targets` (n, seq_len), IGNORE_INDEX where
    no loss is taken."""
    tokens: np.ndarray
    targets: np.ndarray
    names: list[str]

    def __len__(self) -> int:
        return len(self.names)


def pad_examples(encoded: list[tuple[str, list[int], list[bool]]], seq_len: int, end: int) -> ExampleSet:
    n = len(encoded)
    tokens = np.full((n, seq_len + 1), end, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, (name, ids, trained) in enumerate(encoded):
        ids, trained = ids[:seq_len + 1], trained[:seq_len + 1]
        if not any(trained[1:]):
            raise LmforgeError(f"{name}: the prompt fills all {seq_len} positions, so no response token is "
                               f"left to learn: raise train.seq_len or shorten the prompt")
        tokens[row, :len(ids)] = ids
        # position t predicts token t + 1: a target where token t + 1 is trained
        targets[row, :len(ids) - 1] = np.where(trained[1:], ids[1:], IGNORE_INDEX)
    return ExampleSet(tokens, targets, [name for name, _, _ in encoded])


def example_batch(examples: ExampleSet, batch_size: int, seq_len: int, seed: int, index: int,
                  pin_memory: bool = False, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of batch number `index` of the stream seeded with `seed`: examples drawn
    with replacement, the same on every call and machine (as loader.window_batch draws windows)."""
    if examples.targets.shape[1] != seq_len:
        raise ValueError(f"examples padded to {examples.targets.shape[1]} positions, asked for {seq_len}")
    rows = np.random.default_rng([seed, index]).integers(0, len(examples), size=batch_size * world_size)
    rows = rows[rank * batch_size: (rank + 1) * batch_size]
    x = torch.from_numpy(examples.tokens[rows, :-1])
    y = torch.from_numpy(examples.targets[rows])
    if pin_memory:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


def jsonl_files(source: str) -> list[Path]:
    """The .jsonl files a data.source names (files, or the .jsonl files in folders)."""
    files = []
    for raw in (p.strip() for p in source.split(",") if p.strip()):
        path = Path(raw).expanduser()
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        elif path.suffix == ".jsonl" and path.is_file():
            files.append(path)
    check_listed_once(files)
    return files


def is_example_source(source: str) -> bool:
    """Whether data.source holds fine-tuning examples (its first .jsonl record has "prompt" or
    "messages") rather than plain text."""
    if source == "stdlib":
        return False
    for file in jsonl_files(source):
        for line in read_text(file).splitlines():
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False  # corpus.py names the bad line
                return isinstance(record, dict) and ("prompt" in record or "messages" in record)
    return False


def read_records(source: str) -> list[Document]:
    """Every example line of the source's .jsonl files, as a Document named path:line holding the
    raw line (split_documents splits by name, so the train/validation split is stable)."""
    records = []
    for raw in (p.strip() for p in source.split(",") if p.strip()):
        path = Path(raw).expanduser()
        if not path.exists():
            raise LmforgeError(f"data source {raw} does not exist: give .jsonl files or folders")
        if path.is_file() and path.suffix != ".jsonl":
            raise LmforgeError(f"{raw}: fine-tuning examples are read from .jsonl files; plain text "
                               f"cannot be mixed with them in one data.source")
    for file in jsonl_files(source):
        records += [Document(f"{file.name}:{number}", line)
                    for number, line in enumerate(read_text(file).splitlines(), start=1) if line.strip()]
    if len(records) < 2:  # split_documents would cut a lone example's line in two
        raise LmforgeError(f"data source {source!r} holds {len(records) or 'no'} example{'s' * (not records)}: "
                           f"fine-tuning needs at least two, one held out for validation (data.val_fraction)")
    return records


def load_examples(source: str, tokenizer, seq_len: int, val_fraction: float, end_token: str = END_OF_TEXT,
                  special: SpecialTokens | None = None) -> tuple[ExampleSet, ExampleSet, dict]:
    """Train and validation examples of `source`, and their statistics (meta.json's fields); each
    example ends with a stop token of the model (`special`, by default lmforge's own: `end_token`,
    data.end_token)."""
    special = special or special_tokens(tokenizer, end_token)
    train_docs, val_docs = split_documents(read_records(source), val_fraction)
    end = special.end_id
    sets, splits, trained_ids = {}, {}, []
    for split, docs in (("train", train_docs), ("val", val_docs)):
        encoded, trained_bytes = [], 0
        for doc in docs:
            try:
                record = json.loads(doc.text)
            except json.JSONDecodeError as err:
                raise LmforgeError(f"{doc.name} is not valid JSON ({err.msg})") from None
            ids, trained, n_bytes = encode_record(tokenizer, record, doc.name, special)
            encoded.append((doc.name, ids, trained))
            trained_bytes += n_bytes
        sets[split] = pad_examples(encoded, seq_len, end)
        targets = sets[split].targets
        splits[split] = {"tokens": int((targets != IGNORE_INDEX).sum()), "documents": len(docs),
                         "bytes": trained_bytes}
        if split == "train":
            trained_ids = targets[targets != IGNORE_INDEX]
    digest = hashlib.sha256("".join(d.name + d.text for d in train_docs + val_docs).encode()).hexdigest()
    meta = {"source": source, "source_sha256": digest, "splits": splits,
            "unigram_entropy_nats": unigram_entropy(trained_ids, tokenizer.get_vocab_size())}
    return sets["train"], sets["val"], meta
