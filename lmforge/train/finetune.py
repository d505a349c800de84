"""Fine-tuning: the data of a run in its base's tokenizer (the base itself is read by
lmforge/runs/load.py).

A fine-tuning run (`lmforge finetune`, config section `finetune`) trains on the same Trainer as
`lmforge train`; only three things differ, all set up here:
  - the weights start from the base (`load_base`) instead of a random initialisation;
  - the data is tokenized with the base's tokenizer (never a new one), in memory: plain text as
    windows of a token stream like pretraining, or examples (data/sft.py) padded one per row;
  - the run records which base it was trained on (`base_identity`: the base checkpoint's name and
    the sha256 of its weights), so that a LoRA run, whose checkpoints hold only the adapters, is
    never resumed or sampled on another base.

`prepare_run_data` gives the Trainer either: data/prepare.py's prepared data, or this.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from lmforge.config import Config
from lmforge.data.corpus import load_documents, split_documents
from lmforge.data.loader import check_windows, window_batch
from lmforge.data.prepare import PreparedData, data_dir_of, prepare_data
from lmforge.data.sft import example_batch, is_example_source, load_examples
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.data.tokenizer import encode_documents, tokenizer_hash
from lmforge.data.tokens import unigram_entropy
from lmforge.common.errors import LmforgeError
from lmforge.parallel.world import World
from lmforge.runs.load import base_identity, load_base
from lmforge.train.setup import check_data


@dataclass
class FinetuneData:
    """What the Trainer reads of prepared data (as data/prepare.py's PreparedData), made in memory."""
    dir: Path  # the data source, for messages
    meta: dict  # tokenizer_sha256, tokenizer_vocab_size, splits, unigram_entropy_nats
    tokenizer: Tokenizer
    train: object  # a token array (plain text) or an ExampleSet
    val: object
    batches: Callable = field(default=window_batch)  # loader.window_batch or sft.example_batch
    default_prompt: str = ""  # the end-of-run sample's prompt: the start of a validation document or example


def prepare_finetune(cfg: Config, log=print) -> tuple[FinetuneData, dict[str, torch.Tensor], dict]:
    """The data of a fine-tuning run in its base's tokenizer, the base's weights and its identity."""
    base_cfg, state, tokenizer = load_base(cfg.finetune.base)
    if base_cfg != cfg.model:
        changed = [key for key, value in vars(base_cfg).items() if getattr(cfg.model, key) != value]
        raise LmforgeError(f"the run's model.{changed[0]} differs from its base's ({cfg.finetune.base}): "
                           f"a fine-tuning run keeps the base's model settings")
    identity = base_identity(cfg.finetune.base)
    source, seq_len = cfg.data.source, cfg.seq_len
    if is_example_source(source):
        train, val, meta = load_examples(source, tokenizer, seq_len, cfg.data.val_fraction, cfg.data.end_token)
        batches = example_batch
        first = val.tokens[0]
        prompt_end = int(np.argmax(val.targets[0] != IGNORE_INDEX)) + 1  # tokens before the first target
        prompt = tokenizer.decode(first[:prompt_end].tolist())
        log(f"fine-tuning data: {len(train)} train / {len(val)} val examples from {source}, padded to {seq_len} "
            f"tokens, loss on {meta['splits']['train']['tokens']:,} response tokens")
    else:
        train_docs, val_docs = split_documents(load_documents(source), cfg.data.val_fraction)
        train, val = (np.concatenate(list(encode_documents(tokenizer, (d.text for d in docs), end_token=cfg.data.end_token)))
                      for docs in (train_docs, val_docs))
        check_windows(len(train), len(val), seq_len)
        meta = {"source": source, "splits": {
            split: {"tokens": len(tokens), "documents": len(docs), "bytes": sum(len(d.text.encode()) for d in docs)}
            for split, tokens, docs in (("train", train, train_docs), ("val", val, val_docs))},
            "unigram_entropy_nats": unigram_entropy(train, tokenizer.get_vocab_size())}
        batches, prompt = window_batch, ""  # "": the summary's own default, the start of a validation document
        log(f"fine-tuning data: {len(train):,} train / {len(val):,} val tokens of plain text from {source}")
    meta.update(tokenizer_sha256=tokenizer_hash(tokenizer), tokenizer_vocab_size=tokenizer.get_vocab_size())
    data = FinetuneData(Path(source), meta, tokenizer, train, val, batches, prompt)
    return data, state, identity


def prepare_run_data(cfg: Config, world: World, log, warn, progress: bool
                     ) -> tuple[PreparedData | FinetuneData, dict[str, torch.Tensor] | None, dict | None]:
    """The data of any run, made by rank 0 first (once, under the data folder's lock), then opened
    by the others, who wait for it however long it takes (World.main_first); with the weights and
    identity of a fine-tuning run's base (None for a run from scratch, whose prepared data is
    checked against its model here)."""
    if cfg.finetune.base is None:
        data = world.main_first(lambda: prepare_data(cfg, log=log, progress=progress),
                                doing=f"prepare {data_dir_of(cfg)}")
        check_data(cfg, data, warn=warn)
        return data, None, None
    # rank 0 reads the base while the others wait: a local file read on each rank (runs/checkpoint/
    # read.py), never a collective that would wait for them
    return world.main_first(lambda: prepare_finetune(cfg, log=log),
                            doing=f"read the base {cfg.finetune.base} and the data {cfg.data.source}")
