"""The tokenizer files of a Hugging Face folder: tokenizer.json, the `tokenizers` format lmforge
saves its own tokenizer in, with tokenizer_config.json naming the special tokens."""

import json
from pathlib import Path

from tokenizers import Tokenizer

from lmforge.common.errors import LmforgeError
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
            if isinstance(eos, int) and tokenizer.id_to_token(eos) is not None:
                return tokenizer.id_to_token(eos)
    if (folder / "tokenizer_config.json").is_file():
        eos = read_json(folder / "tokenizer_config.json").get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    raise LmforgeError(f"{folder} names no end-of-text token (eos_token_id in config.json): add it there")


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path, end_token: str, max_length: int) -> None:
    """tokenizer.json and a tokenizer_config.json that makes it a PreTrainedTokenizerFast."""
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end_token, "eos_token": end_token,
                        "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
