"""Byte-level BPE (Sennrich et al. 2016; byte-level as in GPT-2) with Hugging Face `tokenizers`.

Byte-level means the base alphabet is the 256 byte values, so any UTF-8 text encodes without an
unknown token; merges are learned from the training split only. One special token,
END_OF_TEXT, separates documents in the token stream.
"""

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.common.errors import LmforgeError
from lmforge.data.special_tokens import HF_TOKENIZER_FILES, SpecialTokens, special_tokens

END_OF_TEXT = "<|endoftext|>"


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


def load_special_tokens(folder: str | Path, tokenizer: Tokenizer, end_token: str = END_OF_TEXT) -> SpecialTokens:
    """The special tokens of the model whose tokenizer.json is in `folder` (a checkpoint): the
    Hugging Face files kept beside it, if any (data/special_tokens.py)."""
    folder = Path(folder)
    files = {name: (folder / name).read_bytes() for name in HF_TOKENIZER_FILES if (folder / name).is_file()}
    return special_tokens(tokenizer, end_token, files)
