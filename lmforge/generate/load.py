"""The model `lmforge generate` and `lmforge chat` sample from, with its special tokens."""

from pathlib import Path

from lmforge.interop.peft import apply_peft_adapter
from lmforge.model.transformer import Transformer
from lmforge.runs.checkpoint.find import find_checkpoint
from lmforge.runs.load import is_hf_folder, load_base, model_from_checkpoint, model_special_tokens


def load_model(path: str | Path, adapter: str | None = None, merge: bool = False, warn=None):
    """(model, tokenizer, special tokens) of an lmforge run folder (its newest good checkpoint; a
    LoRA run as its base + adapters, folded in with `merge`) or a Hugging Face folder, with the PEFT
    adapter folder `adapter` on top if given. On the CPU in fp32."""
    path = Path(path)
    if is_hf_folder(path):
        model_cfg, state, tokenizer = load_base(path)
        model = Transformer(model_cfg)
        model.load_state_dict(state)
        source = path
    else:
        source = find_checkpoint(path, warn=warn)
        cfg, model, tokenizer = model_from_checkpoint(source, merge=merge)
        model_cfg = cfg.model
    if adapter is not None:
        apply_peft_adapter(model, adapter, model_cfg)
    return model.eval(), tokenizer, model_special_tokens(source, tokenizer)
