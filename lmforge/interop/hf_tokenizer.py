"""The tokenizer files of a Hugging Face folder: tokenizer.json, the `tokenizers` format lmforge
saves its own tokenizer in, and the files beside it that name the special tokens, hold the chat
template and the generation defaults (data/special_tokens.py's HF_TOKENIZER_FILES), read and
written back byte for byte."""

import json
from pathlib import Path

from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
from lmforge.data.special_tokens import HF_TOKENIZER_FILES, SpecialTokens, special_tokens, json_object
from lmforge.interop.hf_config import read_json


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
