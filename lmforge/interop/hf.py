"""Hugging Face model folders in and out: the llama family as `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM` or `Qwen3ForCausalLM` (by its build-time choices: hf_config.py), gpt as `GPT2LMHeadModel`.

A Hugging Face folder holds config.json (architecture and shapes: hf_config.py), model.safetensors
(weights by HF's names, hf_names.py; a large model shards it, listed in model.safetensors.index.json)
and its tokenizer: tokenizer.json, the `tokenizers` format lmforge saves its own tokenizer in, and
the files beside it that name the special tokens, hold the chat template and the generation
defaults (data/special_tokens.py's HF_TOKENIZER_FILES), read and written back byte for byte.
lmforge reads and writes these files itself; transformers is needed only to check the result
(tests/test_interop.py loads what it writes).
"""

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.config import ModelConfig
from lmforge.data.corpus import END_OF_TEXT
from lmforge.data.special_tokens import HF_TOKENIZER_FILES, SpecialTokens, json_object, special_tokens
from lmforge.interop.hf_config import hf_config, read_json, read_model_config
from lmforge.interop.hf_names import check_state, from_hf_state, to_hf_state


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


def _open_weights(folder: Path):
    """Each of the folder's weight files, opened (safe_open reads the header, the tensors on demand);
    one line for a corrupt one (a damaged header or a file shorter than it says)."""
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as weights:
                yield weights
        except SafetensorError as err:
            raise LmforgeError(f"{file} is corrupt: {err}") from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, in the dtype stored."""
    return {name: weights.get_tensor(name) for weights in _open_weights(folder) for name in weights.keys()}


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def hf_weights_dtype(folder: str | Path) -> torch.dtype:
    """The floating dtype most of the folder's weights are stored in, from the safetensors headers
    alone (no tensor is read)."""
    elements: dict[str, int] = {}
    for weights in _open_weights(Path(folder)):
        for name in weights.keys():
            tensor = weights.get_slice(name)
            dtype = tensor.get_dtype()
            elements[dtype] = elements.get(dtype, 0) + math.prod(tensor.get_shape())
    floating = {name: count for name, count in elements.items() if name in SAFETENSORS_DTYPES}
    if not floating:
        raise LmforgeError(f"{folder} holds no floating-point weights")
    return SAFETENSORS_DTYPES[max(floating, key=floating.get)]


def read_hf_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise LmforgeError(f"{folder} has no tokenizer.json (lmforge needs the fast tokenizer): save one there "
                           f"with transformers' AutoTokenizer.from_pretrained(...).save_pretrained")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise LmforgeError(f"{path} is unreadable ({str(err).splitlines()[0]})") from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise LmforgeError(f"{path} has {tokenizer.get_vocab_size()} tokens, more than the model's {vocab_size}: "
                           f"the tokenizer belongs to another model")
    return tokenizer


def read_end_token(folder: Path, tokenizer: Tokenizer) -> str:
    """The token that ends a document: the first eos_token_id of generation_config.json or config.json
    (a list in instruction-tuned models), else tokenizer_config.json's eos_token."""
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            eos = read_json(folder / name).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int) and 0 <= eos < 2**31 and tokenizer.id_to_token(eos) is not None:
                return tokenizer.id_to_token(eos)
    if (folder / "tokenizer_config.json").is_file():
        eos = read_json(folder / "tokenizer_config.json").get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    raise LmforgeError(f"{folder} names no end-of-text token (eos_token_id in config.json): add it there")


def read_hf_tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The files of HF_TOKENIZER_FILES that `folder` has, as bytes. Without generation_config.json,
    one made of config.json's bos_token_id and eos_token_id, as transformers makes it; one that names
    no eos_token_id gets config.json's, so that the model stops where its config says its turn ends
    (in this folder and in any run imported from it)."""
    files = {name: (folder / name).read_bytes() for name in HF_TOKENIZER_FILES if (folder / name).is_file()}
    generation = json_object(files, "generation_config.json")
    if "eos_token_id" not in generation and (folder / "config.json").is_file():
        config = read_json(folder / "config.json")
        keys = ("eos_token_id",) if "generation_config.json" in files else ("bos_token_id", "eos_token_id")
        ids = {key: config[key] for key in keys if config.get(key) is not None}
        if ids or "generation_config.json" not in files:
            files["generation_config.json"] = (json.dumps({**generation, **ids}, indent=2) + "\n").encode()
    return files


def read_hf_special_tokens(folder: Path, tokenizer: Tokenizer) -> SpecialTokens:
    """The special tokens, stop tokens and chat template of HF folder `folder`."""
    return special_tokens(tokenizer, read_end_token(folder, tokenizer), read_hf_tokenizer_files(folder))


def hf_token_ids(special: SpecialTokens) -> dict:
    """config.json's bos_token_id and eos_token_id: the model's own (an eos list stays a list);
    lmforge's models start and end with their end-of-text token."""
    eos = json.loads(special.files.get("generation_config.json", b"{}")).get("eos_token_id")
    return {"bos_token_id": special.bos_ids[0] if special.bos_ids else special.end_id,
            "eos_token_id": eos if eos is not None else special.end_id}


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path, max_length: int, special: SpecialTokens) -> None:
    """tokenizer.json with the model's own files beside it (HF_TOKENIZER_FILES, as they came in);
    a model lmforge trained gets a tokenizer_config.json that makes it a PreTrainedTokenizerFast
    and a generation_config.json naming its end-of-text token."""
    tokenizer.save(str(out / "tokenizer.json"))
    for name, content in special.files.items():
        (out / name).write_bytes(content)
    if "tokenizer_config.json" not in special.files:
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special.end,
                            "eos_token": special.end, "model_max_length": max_length,
                            "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if "generation_config.json" not in special.files:
        (out / "generation_config.json").write_text(json.dumps(hf_token_ids(special)) + "\n")


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """An HF Llama, Mistral, Qwen2, Qwen3 or GPT-2 folder as lmforge's config, state dict (lmforge's names,
    the file's dtype)
    and tokenizer. The end-of-text token is `read_end_token(folder, tokenizer)` ."""
    folder = Path(folder)
    cfg = read_model_config(folder)
    tokenizer = read_hf_tokenizer(folder, cfg.vocab_size)
    state = from_hf_state(cfg, read_hf_weights(folder), where=str(folder))
    return cfg, state, tokenizer


def export_hf(model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer,
              out_dir: str | Path, end_token: str = END_OF_TEXT, special: SpecialTokens | None = None) -> None:
    """Write an HF folder that transformers' Auto classes load: config.json, generation_config.json,
    model.safetensors and the tokenizer as a PreTrainedTokenizerFast, with the model's own token
    files (`special`: its chat template, eos list, bos, generation defaults) as they came in.
    `out_dir` is written into as given (runs/folders.py stages it); the architecture is model_cfg's
    (hf_config.py's hf_architecture)."""
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
