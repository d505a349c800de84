"""`lmforge prepare`: corpus -> train/val split -> BPE tokenizer -> token files, in one folder.

The folder (data.dir, default data/<source>-bpe<vocab_size>) holds tokenizer.json, train.bin,
val.bin and meta.json. It is built in a temporary folder and renamed into place when complete, so
an interrupted run leaves nothing half-written (and a staging folder left by a kill is removed by
the next prepare); a later run with the same source and settings reuses it, and a folder
prepared with other settings is never overwritten. One process at a time prepares a folder: a
second is refused, naming the first one's PID.
"""

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from lmforge.config import Config
from lmforge.data.corpus import (encode_documents, fingerprint, load_documents, load_tokenizer, source_stamp,
                                 split_documents, stdlib_name, tokenizer_hash, train_tokenizer)
from lmforge.data.loader import check_windows
from lmforge.common.errors import LmforgeError, as_os_error
from lmforge.common.folders import FolderLock


# Token files: a flat array of token ids on disk, read back with `numpy.memmap`.
#
# Each split is one `<split>.bin` (uint16 when the vocabulary fits in 16 bits, else uint32; native
# little-endian) described by `meta.json` beside it: dtype, token count, the sha256 of the
# tokenizer that wrote it. A file whose size does not match its count is reported as truncated
# rather than silently read short.
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


@dataclass
class PreparedData:
    dir: Path
    meta: dict
    tokenizer: Tokenizer
    train: np.memmap
    val: np.memmap


def default_data_dir(cfg: Config) -> Path:
    source = cfg.data.source
    if source == "stdlib":
        name = stdlib_name()
    else:
        first = Path(source.split(",")[0].strip()).name or "data"
        name = f"{Path(first).stem}-{hashlib.sha1(source.encode()).hexdigest()[:8]}"
    return Path("data") / f"{name}-bpe{cfg.model.vocab_size}"


def data_dir_of(cfg: Config) -> Path:
    """The folder cfg's data is prepared in: data.dir, or the default for its source and vocabulary."""
    return Path(cfg.data.dir) if cfg.data.dir else default_data_dir(cfg)


def prepare_data(cfg: Config, log: Callable[[str], None] = print, progress: bool = True,
                 tokenizer_sha256: str | None = None) -> PreparedData:
    """Prepared data for cfg, reused when it exists with the same settings, else built. A folder whose
    meta records the same stamp of the source's files (names, sizes, times) is reused without reading
    the corpus; otherwise the corpus is read and its sha256 compared with the one the folder records.
    `tokenizer_sha256`: the tokenizer a resumed run's checkpoint was trained with; a corpus that now
    trains another is refused before anything is written."""
    data_dir = data_dir_of(cfg)
    stamp = source_stamp(cfg.data.source)
    settings = _settings(cfg)
    if data_dir.exists() and read_meta(data_dir).get("source_stamp") == stamp:
        return _reuse(data_dir, settings)  # no file of the source changed since: its source_sha256 still holds
    docs = load_documents(cfg.data.source)
    settings["source_sha256"] = fingerprint(docs)
    if data_dir.exists():
        return _reuse(data_dir, settings)
    new_parent = not data_dir.parent.exists()
    try:
        # One process prepares a folder; the lock also covers the check above's "not there yet".
        with FolderLock(data_dir, "preparing data"):
            if data_dir.exists():  # prepared by another process while we gathered the documents
                return _reuse(data_dir, settings)
            settings["source_stamp"] = stamp
            for leftover in data_dir.parent.glob(f".{data_dir.name}.partial-*"):  # from a killed prepare
                shutil.rmtree(leftover, ignore_errors=True)
            _build(data_dir, docs, settings, cfg, log, progress, tokenizer_sha256)
    except BaseException:
        if new_parent and not any(data_dir.parent.iterdir()):  # a refusal or failure leaves no empty data/
            data_dir.parent.rmdir()
        raise
    return open_prepared(data_dir)


def open_run_data(cfg: Config) -> PreparedData:
    """A resumed run's data: its folder opened as it was prepared, checked against cfg's settings;
    the source is not read again (a relative data.source names files relative to where the run
    started, which a resume from elsewhere would not find)."""
    return _reuse(data_dir_of(cfg), _settings(cfg))


def _settings(cfg: Config) -> dict:
    """What a prepared folder must have been prepared with to serve cfg (its meta.json records them)."""
    return {"source": cfg.data.source, "vocab_size": cfg.model.vocab_size, "val_fraction": cfg.data.val_fraction}


def _reuse(data_dir: Path, settings: dict) -> PreparedData:
    meta = read_meta(data_dir)
    changed = [k for k, v in settings.items() if meta.get(k) != v]
    if changed:
        raise LmforgeError(f"{data_dir} holds data prepared with a different {', '.join(changed)}: "
                           f"set data.dir to a new folder, or delete {data_dir}")
    return open_prepared(data_dir)


def _build(data_dir: Path, docs: list, settings: dict, cfg: Config, log: Callable[[str], None],
           progress: bool, tokenizer_sha256: str | None) -> None:
    """Split, train the tokenizer (checked against `tokenizer_sha256` first, if given) and write the
    token files in a staging folder, renamed into place when complete."""
    started = time.perf_counter()
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    log(f"preparing {data_dir}: {len(docs)} documents ({sum(len(d.text) for d in docs) / 1e6:.1f} MB), "
        f"{len(train_docs)} train / {len(val_docs)} val")
    tokenizer = train_tokenizer((d.text for d in train_docs), cfg.model.vocab_size)
    if tokenizer_sha256 is not None and tokenizer_hash(tokenizer) != tokenizer_sha256:
        raise LmforgeError(f"data.source={cfg.data.source} no longer gives the tokenizer the run's checkpoint was "
                           f"trained with (the corpus changed): pass data.dir=FOLDER, the run's original data")
    staging = data_dir.parent / f".{data_dir.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        tokenizer.save(str(staging / "tokenizer.json"))
        log(f"  tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens "
            f"({time.perf_counter() - started:.1f}s)")
        dtype = token_dtype(tokenizer.get_vocab_size())
        splits = {}
        with tqdm(total=sum(len(d.text) for d in docs), unit="char", unit_scale=True, desc="  encoding",
                  disable=not progress, leave=False) as bar:
            for split, split_docs in (("train", train_docs), ("val", val_docs)):
                count = write_tokens(staging / f"{split}.bin",
                                     encode_documents(tokenizer, _counted(split_docs, bar)), dtype)
                splits[split] = {"tokens": count, "documents": len(split_docs),
                                 "bytes": sum(len(d.text.encode()) for d in split_docs)}
        check_windows(splits["train"]["tokens"], splits["val"]["tokens"], cfg.seq_len)  # refused: nothing kept
        meta = {"format": META_FORMAT, **settings, "tokenizer_sha256": tokenizer_hash(tokenizer),
                "tokenizer_vocab_size": tokenizer.get_vocab_size(), "dtype": dtype.name, "splits": splits}
        meta["unigram_entropy_nats"] = unigram_entropy(open_tokens(staging, "train", meta),
                                                       tokenizer.get_vocab_size())
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
        os.rename(staging, data_dir)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise as_os_error(err, data_dir)  # a full disk: an OSError naming the folder
    log(f"  tokens: {tokens_line(meta)} ({time.perf_counter() - started:.1f}s)")


def tokens_line(meta: dict) -> str:
    """The prepared splits in one line, from meta.json (`lmforge report` shows it too)."""
    splits = meta["splits"]
    return (f"{splits['train']['tokens']:,} train, {splits['val']['tokens']:,} val ({meta['dtype']}), "
            f"{splits['train']['bytes'] / splits['train']['tokens']:.2f} bytes/token, "
            f"unigram entropy {meta['unigram_entropy_nats']:.3f} nats")


def _counted(docs, bar: tqdm):
    for doc in docs:
        bar.update(len(doc.text))
        yield doc.text


def open_prepared(data_dir: str | Path) -> PreparedData:
    """Open a prepared folder, checking that its tokenizer and token files belong together."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    tokenizer = load_tokenizer(data_dir / "tokenizer.json")
    if tokenizer_hash(tokenizer) != meta["tokenizer_sha256"]:
        raise LmforgeError(f"{data_dir}/tokenizer.json does not match the tokenizer its token files were "
                           f"written with: delete {data_dir} and prepare the data again")
    splits = {split: open_tokens(data_dir, split, meta) for split in ("train", "val")}
    vocab = meta["tokenizer_vocab_size"]
    for split, tokens in splits.items():
        largest = int(tokens.max())  # one pass over the memmap: cheap next to training on it
        if largest >= vocab:
            raise LmforgeError(f"{data_dir}/{split}.bin holds token id {largest}, but its tokenizer has "
                               f"{vocab} tokens: the file is corrupt; delete {data_dir} and prepare the data again")
    return PreparedData(data_dir, meta, tokenizer, splits["train"], splits["val"])
