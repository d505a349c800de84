"""A model from a run folder or a Hugging Face folder: what `generate`, `export`, `plan`,
`eval-format` and a fine-tuning run's base read, through one loader (`load_model`).

A folder is one of three kinds (`model_folder`): an lmforge run folder (config.yaml, checkpoints/),
one checkpoint of it, or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json;
also a hub cache's models--org--name folder, read at the snapshot refs/main names). A Hugging Face
folder is read as it is, with no copy made (`lmforge import-hf` makes a run folder of one).

Weights keep the dtype they are stored in unless another is asked for (`dtype`): a bf16 download
is built as a bf16 model, its tensors assigned, never first initialised in fp32.

A fine-tuning run records which base it was trained on (`base_identity`: the base checkpoint's name
and the sha256 of its weights), so that a LoRA run, whose checkpoints hold only the adapters, is
never resumed or sampled on another base.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError, lookup, warn_once
from lmforge.config import Config, DataConfig, ModelConfig, load_config
from lmforge.data.corpus import load_tokenizer
from lmforge.data.special_tokens import SpecialTokens, load_special_tokens
from lmforge.interop.hf import hf_weights_dtype, import_hf
from lmforge.interop.hf_config import read_model_config
from lmforge.interop.hf import read_end_token, read_hf_special_tokens, read_hf_tokenizer
from lmforge.model.lora import apply_lora, has_lora, merge_lora
from lmforge.model.transformer import Transformer, meta_model
from lmforge.runs.checkpoint.find import (check_whole_config, file_sha256, find_checkpoint, read_manifest, read_state,
                                          verify_checkpoint)
from lmforge.runs.checkpoint.read import load_model_weights, read_tensors
from lmforge.runs.checkpoint.tensors import stored_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype's choices, and auto
KINDS = ("an lmforge run folder (config.yaml, checkpoints/) or a Hugging Face model folder (config.json, "
         "*.safetensors, tokenizer.json)")


def model_folder(path: str | Path) -> tuple[str, Path]:
    """("run" | "checkpoint" | "hf", the folder to read) for a model folder named on the command
    line; one line saying what was expected if it is none of them."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise LmforgeError(f"{path} does not exist: give {KINDS}" if not path.exists() else
                           f"{path} is a file: give {KINDS}")
    if (path / "manifest.json").is_file():
        return "checkpoint", path
    if (path / "config.yaml").is_file():
        return "run", path
    if (path / "snapshots").is_dir() and (path / "refs" / "main").is_file():  # a hub cache's models--org--name
        path = path / "snapshots" / (path / "refs" / "main").read_text().strip()
    if (path / "config.json").is_file():
        return "hf", path
    raise LmforgeError(f"{path} is neither {KINDS.replace(' or ', ' nor ')}")


def results_folder(path: str | Path, out: str | None, name: str = "") -> Path:
    """Where a command's results about model `path` go: --out, else its run folder (a checkpoint's
    run) / `name`. A Hugging Face folder needs --out: lmforge writes nothing into a model's folder
    (a download, perhaps a hub cache's snapshot). A file there is refused before any work."""
    kind, folder = model_folder(path)
    if out is None and kind == "hf":
        raise LmforgeError(f"{path} is a Hugging Face folder: give --out for the results (lmforge writes nothing "
                           f"into a model's folder)")
    target = Path(out) if out else (folder if kind == "run" else folder.parent.parent) / name
    if target.exists() and not target.is_dir():
        raise LmforgeError(f"--out {target} is a file: give a folder for the results")
    return target


def is_hf_folder(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def base_checkpoint(path: Path) -> Path:
    """The newest good checkpoint of lmforge run folder `path` (a fine-tuning base, or a run to load);
    a newer damaged one skipped is said once, however many readers look the base up."""
    if not path.is_dir():
        raise LmforgeError(f"base {path} does not exist: give an lmforge run folder")
    if not (path / "config.yaml").is_file():
        raise LmforgeError(f"base {path} is not an lmforge run folder (no config.yaml) nor a Hugging Face "
                           f"folder (no config.json)")
    return find_checkpoint(path, warn=warn_once)


def base_settings(path: str | Path) -> tuple[ModelConfig, str, Tokenizer]:
    """The model config, end-of-document token and tokenizer of a fine-tuning base, read without
    its weights: an lmforge run folder's config.yaml, or a Hugging Face folder's config and tokenizer."""
    path = Path(path)
    if is_hf_folder(path):
        model_cfg = read_model_config(path)
        tokenizer = read_hf_tokenizer(path, model_cfg.vocab_size)
        return model_cfg, read_end_token(path, tokenizer), tokenizer
    checkpoint = base_checkpoint(path)
    cfg = load_config(checkpoint / "config.yaml")
    return cfg.model, cfg.data.end_token, load_tokenizer(checkpoint / "tokenizer.json", end_token=cfg.data.end_token)


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


@dataclass
class LoadedModel:
    """A model ready to run, with what reading it needs: its config (a Hugging Face folder's: its
    model and its end-of-text token as data.end_token), tokenizer, and what was read."""
    cfg: Config
    model: torch.nn.Module
    tokenizer: Tokenizer
    source: Path  # the checkpoint or Hugging Face folder read

    @property
    def end_id(self) -> int:
        return self.tokenizer.token_to_id(self.cfg.data.end_token)


def load_model(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu", merge: bool = False,
               warn=None) -> LoadedModel:
    """The model of a run folder (its newest good checkpoint, newer damaged ones reported through
    `warn`), of one checkpoint, or of a Hugging Face folder, in eval mode on `device` with its
    parameters in `dtype` (a key of DTYPES, or auto: the dtype its weights are stored in; buffers
    such as the rotary tables stay fp32). A LoRA run is its base plus its adapters (folded in with `merge`)."""
    kind, folder = model_folder(path)
    chosen = None if dtype == "auto" else lookup(DTYPES, dtype, "dtype")
    if kind == "hf":
        model_cfg, state, tokenizer = import_hf(folder)
        target = chosen or state["tok_embeddings.weight"].dtype
        cfg = Config(model=model_cfg, data=DataConfig(end_token=read_end_token(folder, tokenizer)))
        return LoadedModel(cfg, model_with_weights(model_cfg, state, target, device), tokenizer, folder)
    checkpoint = checkpoint_of(kind, folder, warn)
    target = chosen or stored_dtype(checkpoint)
    cfg = load_config(checkpoint / "config.yaml")
    if cfg.finetune.lora_rank is None:  # the weights as stored, assigned: no fp32 model first
        tokenizer = load_tokenizer(checkpoint / "tokenizer.json", end_token=cfg.data.end_token)
        model = model_with_weights(cfg.model, read_checkpoint_weights(checkpoint, cfg), target, device,
                                   where=f"checkpoint {checkpoint}")
        return LoadedModel(cfg, model, tokenizer, checkpoint)
    cfg, model, tokenizer = model_from_checkpoint(checkpoint, merge)  # its base + adapters, checked to belong
    for param in dict.fromkeys(model.parameters()):  # tied parameters once; buffers stay fp32
        param.data = param.data.to(target)
    return LoadedModel(cfg, model.to(device).eval(), tokenizer, checkpoint)


def checkpoint_of(kind: str, folder: Path, warn=None) -> Path:
    """The checkpoint a model_folder of kind "checkpoint" (verified) or "run" (its newest good one,
    newer damaged ones reported through `warn`) names."""
    if kind == "checkpoint":
        verify_checkpoint(folder)
        return folder
    return find_checkpoint(folder, warn=warn)


def read_checkpoint_weights(path: Path, cfg: Config) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors by lmforge name, in their stored dtype (not cast to a model's).
    A tied head is stored once, under either name: both names are filled."""
    state = read_tensors(path)
    if cfg.model.tie_embeddings:
        shared = state.get("tok_embeddings.weight", state.get("lm_head.weight"))
        if shared is not None:
            state["tok_embeddings.weight"] = state["lm_head.weight"] = shared
    return state


def model_with_weights(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                       device: str | torch.device = "cpu", where: str = "the weights") -> torch.nn.Module:
    """lmforge's Transformer holding `state` in `dtype` (no copy where it already is): built
    uninitialised, its parameters then assigned, so that a model is never held twice nor in fp32 first."""
    model = meta_model(cfg, device=str(device))
    names = set(model.state_dict())
    if names != set(state):
        other = sorted(names ^ set(state))
        raise LmforgeError(f"{where} and the model's config disagree on {len(other)} tensors ({', '.join(other[:3])}"
                           f"{', ...' if len(other) > 3 else ''}): it was saved from a different model")
    model.load_state_dict({name: t.to(device=device, dtype=dtype) for name, t in state.items()}, assign=True)
    if cfg.tie_embeddings:  # assigned one name at a time: one tensor again, as the model was built
        model.lm_head.weight = model.tok_embeddings.weight
    return model.eval()


def stored_dtype(checkpoint: Path) -> torch.dtype:
    """The dtype a checkpoint stores its model in (a LoRA run: its base's; its adapters are fp32)."""
    f = load_config(checkpoint / "config.yaml").finetune
    if f.base is not None and f.lora_rank is not None:
        kind, base = model_folder(f.base)
        return hf_weights_dtype(base) if kind == "hf" else stored_dtype(base_checkpoint(base))
    dtypes = [dtype for _, dtype in stored_tensors(checkpoint, "model").values()]
    return max(set(dtypes), key=dtypes.count)


def folder_dtype(path: str | Path) -> torch.dtype:
    """The dtype `load_model(path)` builds the model in by default (auto), read without the weights."""
    kind, folder = model_folder(path)
    if kind == "hf":
        return hf_weights_dtype(folder)
    return stored_dtype(folder if kind == "checkpoint" else find_checkpoint(folder))


def folder_config(path: str | Path) -> Config:
    """The config of the model in a folder, without its weights: a run's (or checkpoint's)
    config.yaml, or a Hugging Face folder's model with its end-of-text token."""
    kind, folder = model_folder(path)
    if kind == "hf":
        model_cfg = read_model_config(folder)
        end_token = read_end_token(folder, read_hf_tokenizer(folder, model_cfg.vocab_size))
        return Config(model=model_cfg, data=DataConfig(end_token=end_token))
    if kind == "run":  # a run's own config.yaml, whole (a checkpoint's is read as sealed)
        check_whole_config(folder)
    return load_config(folder / "config.yaml")


def model_special_tokens(path: str | Path, tokenizer: Tokenizer) -> SpecialTokens:
    """The special tokens (stops, BOS, chat template: data/special_tokens.py) of a Hugging Face
    folder, a checkpoint folder, or a run folder's newest good checkpoint."""
    path = Path(path)
    if is_hf_folder(path):
        return read_hf_special_tokens(path, tokenizer)
    checkpoint = path if (path / "manifest.json").is_file() else base_checkpoint(path)
    return load_special_tokens(checkpoint, tokenizer, load_config(checkpoint / "config.yaml").data.end_token)
