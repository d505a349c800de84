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

train/setup.py's `prepare_run_data` gives the Trainer either: data/prepare.py's prepared data, or this.

Before any of it, the command settles two things from the data and the device:
  - `train.seq_len`, if not set, fits examples: the longest one rounded up to a multiple of 8
    (`fitting_seq_len`), never the model's maximum (131,072 positions for Llama 3.x, where every
    padded row would cost as much as the longest context the model can read). 8, not 64: a row
    pays for its padding, and an example of 20 tokens padded to 64 would cost three times its
    compute; 8 keeps the token dimension of every matmul a multiple of 8, the alignment that
    16-bit tensor-core matmuls want (NVIDIA's matrix multiplication performance guide), while
    wasting at most 7 positions per row. Plain text is cut into windows and keeps model.max_seq_len.
  - a step that the plan says cannot fit the device is refused (`check_step_fits`), before the
    base's weights or the data are read.
"""

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from lmforge.accounting.plan.make import Costing, data_parallel, make_plan, matmul_dtype
from lmforge.common.errors import LmforgeError, human_bytes, warn
from lmforge.config import Config
from lmforge.data.corpus import encode_documents, load_documents, split_documents, tokenizer_hash
from lmforge.data.loader import check_windows, window_batch
from lmforge.data.special_tokens import SpecialTokens
from lmforge.data.sft import encode_record, example_batch, is_example_source, load_examples, read_records
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.data.prepare import unigram_entropy
from lmforge.parallel.world import resolve_device
from lmforge.runs.load import base_identity, load_base, model_special_tokens
from lmforge.train.measurements import estimate, rank_share

SEQ_LEN_MULTIPLE = 8  # why 8: the module docstring


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
    special: SpecialTokens | None = None  # the base's stop tokens, BOS and chat template, kept in checkpoints


def prepare_finetune(cfg: Config, log=print) -> tuple[FinetuneData, dict[str, torch.Tensor], dict]:
    """The data of a fine-tuning run in its base's tokenizer, the base's weights and its identity."""
    base_cfg, state, tokenizer = load_base(cfg.finetune.base)
    if base_cfg != cfg.model:
        changed = [key for key, value in vars(base_cfg).items() if getattr(cfg.model, key) != value]
        raise LmforgeError(f"the run's model.{changed[0]} differs from its base's ({cfg.finetune.base}): "
                           f"a fine-tuning run keeps the base's model settings")
    identity = base_identity(cfg.finetune.base)
    special = model_special_tokens(cfg.finetune.base, tokenizer)
    source, seq_len = cfg.data.source, cfg.seq_len
    if is_example_source(source):
        train, val, meta = load_examples(source, tokenizer, seq_len, cfg.data.val_fraction, cfg.data.end_token,
                                         special)
        batches = example_batch
        first = val.tokens[0]
        prompt_end = int(np.argmax(val.targets[0] != IGNORE_INDEX)) + 1  # tokens before the first target
        prompt = tokenizer.decode(first[:prompt_end].tolist())
        log(f"fine-tuning data: {len(train)} train / {len(val)} val examples from {source}, padded to {seq_len} "
            f"tokens, loss on {meta['splits']['train']['tokens']:,} response tokens")
    else:
        train_docs, val_docs = split_documents(load_documents(source), cfg.data.val_fraction)
        end = cfg.data.end_token
        train, val = (np.concatenate(list(encode_documents(tokenizer, (d.text for d in docs), end_token=end)))
                      for docs in (train_docs, val_docs))
        check_windows(len(train), len(val), seq_len)
        meta = {"source": source, "splits": {
            split: {"tokens": len(tokens), "documents": len(docs), "bytes": sum(len(d.text.encode()) for d in docs)}
            for split, tokens, docs in (("train", train, train_docs), ("val", val, val_docs))},
            "unigram_entropy_nats": unigram_entropy(train, tokenizer.get_vocab_size())}
        batches, prompt = window_batch, ""  # "": the summary's own default, the start of a validation document
        log(f"fine-tuning data: {len(train):,} train / {len(val):,} val tokens of plain text from {source}")
    meta.update(tokenizer_sha256=tokenizer_hash(tokenizer), tokenizer_vocab_size=tokenizer.get_vocab_size())
    data = FinetuneData(Path(source), meta, tokenizer, train, val, batches, prompt, special)
    return data, state, identity


def fitting_seq_len(cfg: Config, tokenizer: Tokenizer) -> tuple[int, str] | None:
    """(train.seq_len, a line saying why) for examples in data.source: the longest example's
    positions rounded up to a multiple of SEQ_LEN_MULTIPLE, at most model.max_seq_len; None for
    plain text. An example of n tokens (its end token included) fills a row of n - 1 positions."""
    source = cfg.data.source
    if not is_example_source(source):
        return None
    lengths, special = [], model_special_tokens(cfg.finetune.base, tokenizer)  # as load_examples encodes them
    for doc in read_records(source):
        try:
            record = json.loads(doc.text)
        except json.JSONDecodeError as err:
            raise LmforgeError(f"{doc.name} is not valid JSON ({err.msg})") from None
        lengths.append(len(encode_record(tokenizer, record, doc.name, special)[0]) - 1)
    longest, limit = max(lengths), cfg.model.max_seq_len
    seq_len = min(math.ceil(longest / SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE, limit)
    why = (f"train.seq_len {seq_len}: the longest of {len(lengths):,} examples fills {longest:,} positions, rounded "
           f"up to a multiple of {SEQ_LEN_MULTIPLE}")
    if longest > limit:
        cut = sum(length > limit for length in lengths)
        why = f"{why}, capped at the model's {limit:,} ({cut:,} longer examples are cut)"
    return seq_len, f"{why} (the model reads up to {limit:,}; set train.seq_len to choose)"


def check_step_fits(cfg: Config, machine) -> dict | None:
    """The plan of one step of this run on this process's device; stop with one line if it does
    not fit (total + reserve above the device's memory), naming what to lower. `machine(matmul
    dtype, device)` gives (name, peak FLOP/s, memory bytes), as for the Trainer's plan."""
    device = resolve_device(cfg.train.device)
    shared = rank_share(machine(matmul_dtype(cfg.train.precision), device), device)
    costing = Costing(dp=data_parallel(cfg, int(os.environ.get("WORLD_SIZE", 1))), mfu=1.0)
    plan = estimate("the plan", lambda: make_plan(cfg, costing, shared), warn)  # its failure: one line
    if plan is None or plan["memory"]["fits"]:
        return plan
    mem = plan["memory"]
    parts = sorted(mem["breakdown_bytes"].items(), key=lambda item: -item[1])[:2]
    largest = ", ".join(f"{name.replace('_', ' ')} {human_bytes(value)}" for name, value in parts)
    raise LmforgeError(
        f"one step needs {human_bytes(mem['per_device_bytes'] + mem['reserve_bytes'])} per device ({largest}, "
        f"{human_bytes(mem['reserve_bytes'])} reserve), more than the {human_bytes(mem['device_memory_bytes'])} "
        f"of {shared[0]}: lower train.batch_size (now {cfg.train.batch_size}) or train.seq_len (now "
        f"{cfg.seq_len:,}), or add train.recompute=full (lmforge plan shows the breakdown)")
