"""Text corpora as lists of documents: the embedded default, or the user's own files.

The default corpus is the standard library of the running Python: about 30 MB of real code and
docstrings on every machine, with no download. `site-packages` (which differs per machine),
caches and the few files that are not valid UTF-8 are left out; files are read in sorted order so
that the corpus, and everything derived from it, is the same on every run.

The tokenizer trained on a corpus (at the end of this file) is a byte-level BPE (Sennrich et al.
2016; byte-level as in GPT-2) with Hugging Face `tokenizers`: its base alphabet is the 256 byte
values, so any UTF-8 text encodes without an unknown token; merges are learned from the training
split only. One special token, END_OF_TEXT, separates documents in the token stream.
"""

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.common.errors import LmforgeError

END_OF_TEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")  # read from folders; explicit files may be any text


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier (relative path, or path:line for .jsonl records)
    text: str


def _stdlib_files() -> list[tuple[Path, str]]:
    """The standard library's .py files, in sorted order; its site-packages, dist-packages and
    __pycache__ folders are not entered (site-packages alone holds most files under the root)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in ("site-packages", "dist-packages", "__pycache__")]
        relative = Path(folder).relative_to(root)
        found.extend(relative / name for name in files if name.endswith(".py"))
    return [(root / rel, rel.as_posix()) for rel in sorted(found, key=lambda rel: rel.parts)]


def stdlib_documents() -> list[Document]:
    docs = []
    for path, name in _stdlib_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(name, text))
    return docs


def stdlib_name() -> str:
    return f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"


def _named_files(paths: list[str]) -> list[tuple[Path, str]]:
    """The files behind .txt/.jsonl files and folders, each with its document name: its path from the
    folder given (`a/b.txt` in `notes/`), or its file name."""
    named = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise LmforgeError(f"data source {raw} does not exist: give .txt/.jsonl files or folders, or 'stdlib'")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + (".jsonl",))
            if not files:
                raise LmforgeError(f"data folder {raw} holds no {', '.join(TEXT_SUFFIXES)} or .jsonl files")
            named.extend((file, file.relative_to(path).as_posix()) for file in files)
        else:
            named.append((path, path.name))
    check_listed_once([file for file, _ in named])
    return named


def check_listed_once(files: list[Path]) -> None:
    """A data.source's files, each at most once: one listed twice (or a folder and a file in it)
    would be trained on twice, and its two copies, named alike, fall in the same split."""
    seen = set()
    for file in files:
        if file.resolve() in seen:
            raise LmforgeError(f"data.source names {file} twice: list each file or folder once")
        seen.add(file.resolve())


def _source_paths(source: str) -> list[str]:
    return [p.strip() for p in source.split(",") if p.strip()]


def absolute_source(source: str) -> str:
    """`source` with each file or folder as an absolute path ('stdlib' as it is): what a fine-tuning
    run records, so that a resume from another directory reads the same files. (A run from scratch
    records its prepared folder instead: its source names that folder, data.prepare's default_data_dir.)"""
    if source == "stdlib":
        return source
    return ",".join(os.path.abspath(Path(path).expanduser()) for path in _source_paths(source))


def file_documents(paths: list[str]) -> list[Document]:
    """Documents from .txt/.jsonl files and folders: a text file is one document, a .jsonl file
    holds one document per line as {"text": ...}. A document is named by its path from the folder
    given, or by its file name: the split, a hash of names, then does not depend on where the corpus
    lies on disk."""
    return [doc for file, name in _named_files(paths) for doc in _read_file(file, name)]


def read_text(path: Path) -> str:
    """A corpus or examples file as text: UTF-8, a leading byte-order mark (as Windows editors write
    one) dropped, or one line saying it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise LmforgeError(f"{path} is not UTF-8 text") from None


def _read_file(path: Path, name: str) -> list[Document]:
    text = read_text(path)
    if path.suffix != ".jsonl":
        return [Document(name, text)] if text.strip() else []
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise LmforgeError(f"{path}:{number} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LmforgeError(f'{path}:{number} must be an object with a "text" string')
        if record["text"].strip():
            docs.append(Document(f"{name}:{number}", record["text"]))
    return docs


def load_documents(source: str) -> list[Document]:
    docs = stdlib_documents() if source == "stdlib" else file_documents(_source_paths(source))
    if not docs:
        raise LmforgeError(f"data source {source!r} holds no text")
    return docs


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Train/validation split by document, decided by a hash of each document's name: stable when
    documents are added or removed, and no document leaks across the split. A single document is
    cut at the line nearest to (1 - val_fraction) of its length."""
    if len(docs) == 1:
        text = docs[0].text
        cut = text.rfind("\n", 0, int(len(text) * (1 - val_fraction))) + 1 or int(len(text) * (1 - val_fraction))
        if not 0 < cut < len(text):
            raise LmforgeError("the corpus is a single document too short to split into train and validation")
        return [Document(docs[0].name + "#train", text[:cut])], [Document(docs[0].name + "#val", text[cut:])]

    def position(doc: Document) -> float:
        return int(hashlib.sha1(doc.name.encode()).hexdigest()[:12], 16) / 16**12

    val = [d for d in docs if position(d) < val_fraction]
    if not val:  # tiny corpora: hold out the one document nearest the threshold
        val = [min(docs, key=position)]
    val_names = {d.name for d in val}
    train = [d for d in docs if d.name not in val_names]
    if not train:
        raise LmforgeError("every document fell into the validation split: lower data.val_fraction")
    return train, val


def fingerprint(docs: list[Document]) -> str:
    """sha256 over names and texts: whether prepared token files still match their source."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(b"\0")
        digest.update(doc.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def source_stamp(source: str) -> str:
    """sha256 over the name, size and modification time of every file the source reads, no file
    read: a prepared folder that records it is known to still match its source without hashing the
    corpus again (a file rewritten to the same size within the same nanosecond is missed, as by make)."""
    digest = hashlib.sha256()
    for path, name in _stdlib_files() if source == "stdlib" else _named_files(_source_paths(source)):
        try:
            stat = path.stat()
            digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        except OSError:  # a broken link the standard library holds: read as missing
            digest.update(f"{name}\0missing\0".encode())
    return digest.hexdigest()


# The tokenizer (the module docstring's last paragraph)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: str | Path, end_token: str = END_OF_TEXT) -> Tokenizer:
    """The tokenizer saved at `path`, which must have `end_token` (data.end_token: lmforge's own, or
    the one of a model imported from Hugging Face)."""
    path = Path(path)
    if not path.is_file():
        raise LmforgeError(f"tokenizer {path} not found: run `lmforge prepare` (or train) to build it")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        first_line = str(err).splitlines()[0]
        raise LmforgeError(f"tokenizer {path} is unreadable ({first_line}): prepare the data again") from None
    if tokenizer.token_to_id(end_token) is None:
        raise LmforgeError(f"tokenizer {path} has no {end_token} token: it was not made by lmforge "
                           f"(or data.end_token names the wrong token)")
    return tokenizer


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], batch_size: int = 512,
                     end_token: str = END_OF_TEXT) -> Iterator[np.ndarray]:
    """Token ids of each document followed by `end_token`, yielded one batch of documents at a
    time. `encode_batch` runs each batch on all cores in Rust; batching bounds the memory held."""
    end = tokenizer.token_to_id(end_token)
    batch: list[str] = []

    def flush() -> np.ndarray:
        encodings = tokenizer.encode_batch(batch)
        ids = [np.asarray(e.ids + [end], dtype=np.int64) for e in encodings]
        batch.clear()
        return np.concatenate(ids)

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield flush()
    if batch:
        yield flush()
