"""A model from a run folder or a Hugging Face folder: what `generate`, `export`, `eval-format` and a
fine-tuning run's base read, through one loader.

A fine-tuning run records which base it was trained on (`base_identity`: the base checkpoint's name
and the sha256 of its weights), so that a LoRA run, whose checkpoints hold only the adapters, is
never resumed or sampled on another base.
"""

import hashlib
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.config import Config, ModelConfig, load_config
from lmforge.data.special_tokens import SpecialTokens
from lmforge.data.tokenizer import load_special_tokens, load_tokenizer
from lmforge.interop.hf import import_hf
from lmforge.interop.hf_config import read_model_config
from lmforge.interop.hf_tokenizer import read_end_token, read_hf_special_tokens, read_hf_tokenizer
from lmforge.model.lora import apply_lora, has_lora, merge_lora
from lmforge.model.transformer import Transformer
from lmforge.runs.checkpoint.find import file_sha256, find_checkpoint, read_manifest, read_state
from lmforge.runs.checkpoint.read import load_model_weights


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def base_checkpoint(path: Path) -> Path:
    """The newest good checkpoint of lmforge run folder `path` (a fine-tuning base, or a run to load)."""
    if not path.is_dir():
        raise LmforgeError(f"base {path} does not exist: give an lmforge run folder")
    if not (path / "config.yaml").is_file():
        raise LmforgeError(f"base {path} is not an lmforge run folder (no config.yaml) nor a Hugging Face "
                           f"folder (no config.json)")
    return find_checkpoint(path)


def base_settings(path: str | Path) -> tuple[ModelConfig, str]:
    """The model config and end-of-document token of a fine-tuning base, read without its weights:
    an lmforge run folder's config.yaml, or a Hugging Face folder's config and tokenizer."""
    path = Path(path)
    if is_hf_folder(path):
        model_cfg = read_model_config(path)
        return model_cfg, read_end_token(path, read_hf_tokenizer(path, model_cfg.vocab_size))
    cfg = load_config(base_checkpoint(path) / "config.yaml")
    return cfg.model, cfg.data.end_token


def load_base(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """The base model of a fine-tuning run: its model config, its weights by lmforge parameter name
    and its tokenizer. `path` is an lmforge run folder (its newest good checkpoint; a LoRA run's
    adapters are merged into its own base)."""
    path = Path(path)
    if is_hf_folder(path):  # a Hugging Face Llama or GPT-2 folder, read as lmforge names
        return import_hf(path)
    cfg, state, tokenizer = merged_weights(base_checkpoint(path))
    return cfg.model, state, tokenizer


def base_identity(path: str | Path) -> dict:
    """What a fine-tuning run records of its base: the path given, the checkpoint and the sha256
    of its weights (from the checkpoint's manifest)."""
    path = Path(path)
    if is_hf_folder(path):  # the weight files' own digests, in name order
        digest = hashlib.sha256()
        for file in sorted(path.glob("*.safetensors")):
            if file.name != "adapter_model.safetensors":
                digest.update(file_sha256(file).encode())
        return {"path": str(path), "checkpoint": "hugging face folder", "sha256": digest.hexdigest()}
    checkpoint = base_checkpoint(path)
    manifest = read_manifest(checkpoint)
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
    return model_from_checkpoint(base_checkpoint(Path(path)), merge)


def model_from_checkpoint(checkpoint: Path, merge: bool = False) -> tuple[Config, torch.nn.Module, Tokenizer]:
    """The model of a checkpoint, on the CPU in fp32: a pretrained or fully fine-tuned run as
    saved; a LoRA run as its base plus its adapters (folded into the weights with `merge`)."""
    cfg = load_config(checkpoint / "config.yaml")
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json", end_token=cfg.data.end_token)
    model = Transformer(cfg.model)
    f = cfg.finetune
    if f.base is not None and f.lora_rank is not None:
        saved = read_state(checkpoint).get("base")
        check_same_base(saved, base_identity(f.base), checkpoint)
        _, base_state, _ = load_base(f.base)
        model.load_state_dict(base_state)
        apply_lora(model, f.lora_targets, f.lora_rank, f.lora_alpha, f.lora_dropout)
    load_model_weights(model, checkpoint)  # the adapters alone when LoRA is applied
    if merge and has_lora(model):
        merge_lora(model)
    return cfg, model, tokenizer


def merged_weights(checkpoint: Path) -> tuple[Config, dict[str, torch.Tensor], Tokenizer]:
    """A checkpoint's model as plain weights by lmforge name: a LoRA run's adapters folded into its base."""
    cfg, model, tokenizer = model_from_checkpoint(checkpoint, merge=True)
    state = {name: value for name, value in model.state_dict().items() if not name.endswith((".lora_A", ".lora_B"))}
    return cfg, state, tokenizer


def model_special_tokens(path: str | Path, tokenizer: Tokenizer) -> SpecialTokens:
    """The special tokens (stops, BOS, chat template: data/special_tokens.py) of a Hugging Face
    folder, a checkpoint folder, or a run folder's newest good checkpoint."""
    path = Path(path)
    if is_hf_folder(path):
        return read_hf_special_tokens(path, tokenizer)
    checkpoint = path if (path / "manifest.json").is_file() else base_checkpoint(path)
    return load_special_tokens(checkpoint, tokenizer, load_config(checkpoint / "config.yaml").data.end_token)
