"""Fine-tuning: the base model a run starts from, its data in the base's tokenizer, and the run's
pointer to its base.

A fine-tuning run (`lmforge finetune`, config section `finetune`) trains on the same Trainer as
`lmforge train`; only three things differ, all set up here:
  - the weights start from the base (`load_base`) instead of a random initialisation;
  - the data is tokenized with the base's tokenizer (never a new one), in memory: plain text as
    windows of a token stream like pretraining, or examples (data/sft.py) padded one per row;
  - the run records which base it was trained on (`base_identity`: the base checkpoint's name and
    the sha256 of its weights), so that a LoRA run, whose checkpoints hold only the adapters, is
    never resumed or sampled on another base.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from lmforge.config import Config, ModelConfig, load_config
from lmforge.data.corpus import load_documents, split_documents
from lmforge.data.loader import window_batch
from lmforge.data.sft import IGNORE_INDEX, example_batch, is_example_source, load_examples
from lmforge.data.tokenizer import encode_documents, load_tokenizer, tokenizer_hash
from lmforge.data.tokens import unigram_entropy
from lmforge.errors import LmforgeError
from lmforge.model.lora import apply_lora, has_lora, merge_lora
from lmforge.model.transformer import Transformer
from lmforge.train import checkpoint as ckpt


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


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def _base_checkpoint(path: Path) -> Path:
    if not path.is_dir():
        raise LmforgeError(f"base {path} does not exist: give an lmforge run folder")
    if not (path / "config.yaml").is_file():
        raise LmforgeError(f"base {path} is not an lmforge run folder (no config.yaml) nor a Hugging Face "
                           f"folder (no config.json)")
    return ckpt.find_checkpoint(path)


def base_settings(path: str | Path) -> tuple[ModelConfig, str]:
    """The model config and end-of-document token of a fine-tuning base, read without its weights:
    an lmforge run folder's config.yaml, or a Hugging Face folder's config and tokenizer."""
    path = Path(path)
    if is_hf_folder(path):
        from lmforge.interop.hf import _read_json, model_config_from_hf, read_end_token, read_hf_tokenizer

        model_cfg = model_config_from_hf(_read_json(path / "config.json"), str(path))
        return model_cfg, read_end_token(path, read_hf_tokenizer(path, model_cfg.vocab_size))
    cfg = load_config(_base_checkpoint(path) / "config.yaml")
    return cfg.model, cfg.data.end_token


def load_base(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """The base model of a fine-tuning run: its model config, its weights by lmforge parameter name
    and its tokenizer. `path` is an lmforge run folder (its newest good checkpoint; a LoRA run's
    adapters are merged into its own base)."""
    path = Path(path)
    if is_hf_folder(path):  # a Hugging Face Llama or GPT-2 folder, read as lmforge names
        from lmforge.interop.hf import import_hf

        return import_hf(path)
    cfg, model, tokenizer = load_run_model(path, merge=True)
    state = {name: value for name, value in model.state_dict().items() if not name.endswith((".lora_A", ".lora_B"))}
    return cfg.model, state, tokenizer


def base_identity(path: str | Path) -> dict:
    """What a fine-tuning run records of its base: the path given, the checkpoint and the sha256
    of its weights (from the checkpoint's manifest)."""
    path = Path(path)
    if is_hf_folder(path):  # the weight files' own digests, in name order
        digest = hashlib.sha256()
        for file in sorted(path.glob("*.safetensors")):
            if file.name != "adapter_model.safetensors":
                digest.update(ckpt.file_sha256(file).encode())
        return {"path": str(path), "checkpoint": "hugging face folder", "sha256": digest.hexdigest()}
    checkpoint = _base_checkpoint(path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    # the model's files of the distributed checkpoint (one per rank that wrote it, and .metadata)
    digest = hashlib.sha256()
    for name in sorted(n for n in manifest if n.startswith("model/")):
        digest.update(f"{name}:{manifest[name]['sha256']}".encode())
    return {"path": str(path), "checkpoint": checkpoint.name, "sha256": digest.hexdigest()}


def check_same_base(saved: dict | None, current: dict | None, where: Path) -> None:
    """Stop if `where` (a checkpoint) was trained on another base than the one found now."""
    if (saved or {}).get("sha256") != (current or {}).get("sha256"):
        if saved is None or current is None:
            raise LmforgeError(f"{where} and this run disagree on whether there is a base model: "
                               f"resume it with the command that started it")
        raise LmforgeError(f"{where} is an adapter for another base: it was trained on {saved['path']} "
                           f"({saved['checkpoint']}, weights sha256 {saved['sha256'][:12]}), but {current['path']} "
                           f"now holds {current['checkpoint']} (sha256 {current['sha256'][:12]}): point "
                           f"finetune.base at the original base")


def load_run_model(path: str | Path, merge: bool = False) -> tuple[Config, torch.nn.Module, Tokenizer]:
    """The model of a run's newest good checkpoint (see `model_from_checkpoint`)."""
    return model_from_checkpoint(_base_checkpoint(Path(path)), merge)


def model_from_checkpoint(checkpoint: Path, merge: bool = False) -> tuple[Config, torch.nn.Module, Tokenizer]:
    """The model of a checkpoint, on the CPU in fp32: a pretrained or fully fine-tuned run as
    saved; a LoRA run as its base plus its adapters (folded into the weights with `merge`)."""
    cfg = load_config(checkpoint / "config.yaml")
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json", end_token=cfg.data.end_token)
    model = Transformer(cfg.model)
    f = cfg.finetune
    if f.base is not None and f.lora_rank is not None:
        saved = json.loads((checkpoint / "state.json").read_text()).get("base")
        check_same_base(saved, base_identity(f.base), checkpoint)
        _, base_state, _ = load_base(f.base)
        model.load_state_dict(base_state)
        apply_lora(model, f.lora_targets, f.lora_rank, f.lora_alpha, f.lora_dropout)
    ckpt.load_model_weights(model, checkpoint)  # the adapters alone when LoRA is applied
    if merge and has_lora(model):
        merge_lora(model)
    return cfg, model, tokenizer


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
        if min(len(train), len(val)) < seq_len + 1:
            raise LmforgeError(f"the corpus is too small for windows of {seq_len} tokens ({len(train)} train, "
                               f"{len(val)} val tokens): add text or lower train.seq_len")
        meta = {"source": source, "splits": {
            split: {"tokens": len(tokens), "documents": len(docs), "bytes": sum(len(d.text.encode()) for d in docs)}
            for split, tokens, docs in (("train", train, train_docs), ("val", val, val_docs))},
            "unigram_entropy_nats": unigram_entropy(train, tokenizer.get_vocab_size())}
        batches, prompt = window_batch, ""  # "": the summary's own default, the start of a validation document
        log(f"fine-tuning data: {len(train):,} train / {len(val):,} val tokens of plain text from {source}")
    meta.update(tokenizer_sha256=tokenizer_hash(tokenizer), tokenizer_vocab_size=tokenizer.get_vocab_size())
    data = FinetuneData(Path(source), meta, tokenizer, train, val, batches, prompt)
    return data, state, identity
