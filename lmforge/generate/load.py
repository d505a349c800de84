"""The model `lmforge generate` and `lmforge chat` sample from, with its special tokens (stop
tokens, BOS, chat template) and, if asked, a PEFT adapter on top."""

from pathlib import Path

import torch

from lmforge.data.special_tokens import SpecialTokens
from lmforge.interop.peft import apply_peft_adapter
from lmforge.runs.load import LoadedModel, load_model, model_special_tokens


def load_for_sampling(path: str | Path, adapter: str | Path | None = None, merge: bool = False, dtype: str = "auto",
                      device: str | torch.device = "cpu", warn=None) -> tuple[LoadedModel, SpecialTokens]:
    """runs/load.py's `load_model` of a run, checkpoint or Hugging Face folder, with the PEFT LoRA
    adapter folder `adapter` put on it if given, and the model's special tokens."""
    loaded = load_model(path, dtype, device, merge=merge, warn=warn)
    if adapter is not None:
        apply_peft_adapter(loaded.model, adapter, loaded.cfg.model)
        loaded.model.to(device).eval()
    return loaded, model_special_tokens(loaded.source, loaded.tokenizer)
