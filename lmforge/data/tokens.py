"""Token files: a flat array of token ids on disk, read back with `numpy.memmap`.

Each split is one `<split>.bin` (uint16 when the vocabulary fits in 16 bits, else uint32; native
little-endian) described by `meta.json` beside it: dtype, token count, the sha256 of the
tokenizer that wrote it. A file whose size does not match its count is reported as truncated
rather than silently read short.
"""

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lmforge.common.errors import LmforgeError

META_FORMAT = 1
# what the rest of lmforge reads from meta.json; a file without one of them is refused when read
META_KEYS = ("source", "source_sha256", "vocab_size", "val_fraction", "tokenizer_sha256",
             "tokenizer_vocab_size", "dtype", "splits", "unigram_entropy_nats")
SPLIT_KEYS = ("tokens", "documents", "bytes")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_tokens(path: Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write the chunks one after another into `path`; returns the number of tokens written."""
    count = 0
    with open(path, "wb") as f:
        for chunk in chunks:
            if chunk.size and int(chunk.max()) > np.iinfo(dtype).max:
                raise ValueError(f"token id {int(chunk.max())} does not fit in {dtype}")
            f.write(chunk.astype(dtype).tobytes())
            count += chunk.size
        f.flush()
        os.fsync(f.fileno())
    return count


def read_meta(data_dir: Path) -> dict:
    path = data_dir / "meta.json"
    if not path.is_file():
        raise LmforgeError(f"{data_dir} holds no meta.json: it is not prepared data (run `lmforge prepare`)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise LmforgeError(f"{path} is corrupt: delete {data_dir} and prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise LmforgeError(f"{path} has format {found}, this lmforge reads {META_FORMAT}: prepare again")
    missing = [key for key in META_KEYS if key not in meta]
    splits = meta["splits"] if isinstance(meta.get("splits"), dict) else {}
    if not missing:
        missing = [f"splits.{split}.{key}" for split in ("train", "val") for key in SPLIT_KEYS
                   if not isinstance(splits.get(split), dict) or key not in splits[split]]
    if missing:
        raise LmforgeError(f"{path} lacks {missing[0]!r}: it is incomplete or from another program; "
                           f"delete {data_dir} and prepare the data again")
    return meta


def open_tokens(data_dir: Path, split: str, meta: dict) -> np.memmap:
    """The token ids of `split` as a read-only memmap, checked against meta.json."""
    path = data_dir / f"{split}.bin"
    dtype = np.dtype(meta["dtype"])
    count = meta["splits"][split]["tokens"]
    if not path.is_file():
        raise LmforgeError(f"{path} is missing: prepare the data again")
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise LmforgeError(f"{path} is truncated or corrupt: {size} bytes, expected {count * dtype.itemsize} "
                           f"({count} {dtype} tokens); delete {data_dir} and prepare the data again")
    if count == 0:
        raise LmforgeError(f"{path} holds no tokens: the {split} split is empty")
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """H = -sum_t p(t) ln p(t) over token frequencies, in nats: the loss of the best model that
    ignores context, and the yardstick a trained model must beat."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
