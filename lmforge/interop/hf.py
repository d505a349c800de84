"""Hugging Face model folders in and out: the llama family as `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM` or `Qwen3ForCausalLM` (by its build-time choices: hf_config.py), gpt as `GPT2LMHeadModel`.

A Hugging Face folder holds config.json (architecture and shapes: hf_config.py), model.safetensors
(weights by HF's names, hf_names.py; a large model shards it, listed in model.safetensors.index.json)
and its tokenizer (hf_tokenizer.py). lmforge reads and writes these files itself; transformers is
needed only to check the result (tests/test_interop.py loads what it writes).
"""

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.config import ModelConfig
from lmforge.data.corpus import END_OF_TEXT
from lmforge.interop.hf_config import hf_config, read_json, read_model_config
from lmforge.interop.hf_names import check_state, from_hf_state, to_hf_state
from lmforge.data.special_tokens import SpecialTokens, special_tokens
from lmforge.interop.hf_tokenizer import hf_token_ids, read_hf_tokenizer, write_hf_tokenizer


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed in model.safetensors.index.json; one line if one is missing."""
    index = folder / "model.safetensors.index.json"
    weight_map = read_json(index).get("weight_map") if index.is_file() else {"": "model.safetensors"}
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise LmforgeError(f"{index}: weight_map must map tensor names to file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not (folder / name).is_file():
            bin_only = (folder / "pytorch_model.bin").is_file()
            other = " (lmforge reads safetensors, not pytorch_model.bin)" if bin_only else ""
            raise LmforgeError(f"{folder} has no {name}{other}")
    return [folder / name for name in names]


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, in the dtype stored."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            state.update(load_file(str(file)))
        except SafetensorError as err:
            raise LmforgeError(f"{file} is corrupt: {err}") from None
    return state


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def hf_weights_dtype(folder: str | Path) -> torch.dtype:
    """The floating dtype most of the folder's weights are stored in, from the safetensors headers
    alone (no tensor is read)."""
    elements: dict[str, int] = {}
    for file in weight_files(Path(folder)):
        try:
            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():
                    tensor = weights.get_slice(name)
                    dtype = tensor.get_dtype()
                    elements[dtype] = elements.get(dtype, 0) + math.prod(tensor.get_shape())
        except SafetensorError as err:
            raise LmforgeError(f"{file} is corrupt: {err}") from None
    floating = {name: count for name, count in elements.items() if name in SAFETENSORS_DTYPES}
    if not floating:
        raise LmforgeError(f"{folder} holds no floating-point weights")
    return SAFETENSORS_DTYPES[max(floating, key=floating.get)]


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """An HF Llama, Mistral, Qwen2, Qwen3 or GPT-2 folder as lmforge's config, state dict (lmforge's names,
    the file's dtype)
    and tokenizer. The end-of-text token is `read_end_token(folder, tokenizer)` (hf_tokenizer.py)."""
    folder = Path(folder)
    cfg = read_model_config(folder)
    tokenizer = read_hf_tokenizer(folder, cfg.vocab_size)
    state = from_hf_state(cfg, read_hf_weights(folder), where=str(folder))
    return cfg, state, tokenizer


def export_hf(model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer,
              out_dir: str | Path, family: str | None = None, end_token: str = END_OF_TEXT,
              special: SpecialTokens | None = None) -> None:
    """Write an HF folder that transformers' Auto classes load: config.json, generation_config.json,
    model.safetensors and the tokenizer as a PreTrainedTokenizerFast, with the model's own token
    files (`special`: its chat template, eos list, bos, generation defaults) as they came in.
    `out_dir` is written into as given (runs/folders.py stages it). `family` defaults to, and must
    equal, model_cfg.family."""
    if family is not None and family != model_cfg.family:
        raise LmforgeError(f"cannot export a {model_cfg.family} model as the {family} family")
    check_state(model_cfg, state_dict, where="the model to export")
    if tokenizer.token_to_id(end_token) is None:
        raise LmforgeError(f"the tokenizer has no {end_token} token to end documents with (data.end_token)")
    special = special or special_tokens(tokenizer, end_token)
    dtype = state_dict["tok_embeddings.weight"].dtype
    config = {**hf_config(model_cfg, special.end_id, dtype), **hf_token_ids(special)}  # (may refuse: before writing)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # transformers refuses a safetensors file whose metadata does not say which framework wrote it
    save_file(to_hf_state(model_cfg, state_dict), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_hf_tokenizer(tokenizer, out, model_cfg.max_seq_len, special)
