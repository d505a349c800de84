"""`lmforge export --format hf` and `lmforge import-hf`: run folders and Hugging Face folders.

An imported model becomes a run folder, not a second model format that every command would have
to read: config.yaml (the model section from config.json, `data.end_token` its end-of-text token),
tokenizer.json (the model's own) and checkpoints/step_0000000/ holding the weights with checksums.
`lmforge generate`, `lmforge export` (and fine-tuning) then take it as they take a trained run,
through the one loader that verifies checkpoints; what it costs is one copy of the weights on disk.
The weights keep the file's dtype (a bf16 download stays bf16), so HF -> lmforge -> HF is
bit-identical. Both commands read and check everything before writing, write into a hidden
staging folder, and rename it into place: a failure leaves nothing half-written.
"""

from pathlib import Path

import yaml

from lmforge.common.errors import LmforgeError, warn
from lmforge.common.folders import FolderLock
from lmforge.config import Config, DataConfig, config_to_dict, load_config
from lmforge.data.corpus import load_tokenizer
from lmforge.data.special_tokens import load_special_tokens
from lmforge.interop.hf import export_hf, import_hf
from lmforge.interop.hf import read_end_token, read_hf_special_tokens
from lmforge.interop.peft import lora_target, write_peft_adapter
from lmforge.model.lora import adapter_state_dict, lora_layers
from lmforge.runs.checkpoint.find import CHECKPOINT_DIR, list_checkpoints, read_state
from lmforge.runs.checkpoint.write import write_weights_checkpoint
from lmforge.runs.load import (checkpoint_of, merged_weights, model_folder, model_from_checkpoint,
                               read_checkpoint_weights)
from lmforge.common.folders import write_staged


def _check_free(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LmforgeError(f"{out} already exists: pick another --out, or remove it first")


def export_run(run: str | Path, out: str | Path | None = None, fmt: str = "hf") -> Path:
    """Export the newest checkpoint of a run folder (or the checkpoint given): `hf`, a Hugging Face
    folder (a LoRA run's adapters folded into its base's weights), by default <run>/hf-<checkpoint>;
    `peft`, a LoRA run's adapter alone in PEFT's layout, by default <run>/peft-<checkpoint>. A
    Hugging Face folder is written again as lmforge writes one (to `out`: never into the folder)."""
    kind, folder = model_folder(run)
    if kind == "hf":
        return _export_hf_folder(folder, out, fmt)
    path = checkpoint_of(kind, folder, warn)  # a newer damaged checkpoint skipped is said, as generate says it
    cfg = load_config(path / "config.yaml")
    lora = cfg.finetune.lora_rank is not None
    if fmt == "peft" and not lora:
        raise LmforgeError(f"{run} is not a LoRA run: --format peft writes LoRA adapters; use --format hf")
    tokenizer = load_tokenizer(path / "tokenizer.json", end_token=cfg.data.end_token)
    out = Path(out) if out is not None else path.parent.parent / f"{fmt}-{path.name}"
    _check_free(out)
    if fmt == "peft":
        _, model, _ = model_from_checkpoint(path)  # base + adapters, checked to belong together
        adapter = adapter_state_dict(model)
        targets = sorted({lora_target(name.rsplit(".", 1)[0]) for name in adapter})
        f = cfg.finetune
        alpha = next(iter(lora_layers(model).values())).alpha  # what training used (None in the config: 2 r)
        write_staged(out, lambda folder: write_peft_adapter(adapter, cfg.model, f.lora_rank, alpha, targets,
                                                            folder, dropout=f.lora_dropout))
        return out
    if lora:  # the base with the adapters folded in: a plain model transformers loads alone
        _, state, _ = merged_weights(path)
    else:
        state = read_checkpoint_weights(path, cfg)
    special = load_special_tokens(path, tokenizer, cfg.data.end_token)  # the HF files it came with, if any
    write_staged(out, lambda folder: export_hf(cfg.model, state, tokenizer, folder, end_token=cfg.data.end_token,
                                               special=special))
    return out


def _export_hf_folder(folder: Path, out: str | Path | None, fmt: str) -> Path:
    if fmt == "peft":
        raise LmforgeError(f"{folder} is a Hugging Face folder, not a LoRA run: --format peft writes a LoRA run's "
                           f"adapters; use --format hf")
    if out is None:
        raise LmforgeError(f"{folder} is a Hugging Face folder: give --out "
                           f"(lmforge writes nothing into a model's folder)")
    out = Path(out)
    _check_free(out)
    model_cfg, state, tokenizer = import_hf(folder)
    end_token = read_end_token(folder, tokenizer)
    special = read_hf_special_tokens(folder, tokenizer)  # its template, stop tokens, generation defaults
    write_staged(out, lambda staged: export_hf(model_cfg, state, tokenizer, staged, end_token=end_token,
                                               special=special))
    return out


def check_not_imported(run_dir: Path) -> None:
    """Stop with one line if the run folder holds a model written by `import_run` (weights, no run
    state to resume); checked before `lmforge train --resume` prepares any data."""
    found = list_checkpoints(Path(run_dir))
    try:
        state = read_state(found[-1]) if found else {}
    except LmforgeError:
        return  # a damaged checkpoint: resuming reports it, with the checkpoints it can use instead
    if "imported_from" in state:
        raise LmforgeError(f"{run_dir} holds a model imported from {state['imported_from']}, not a training run "
                           f"to resume: generate from it, or fine-tune it")


def import_run(hf_folder: str | Path, out: str | Path) -> Path:
    """Read an HF folder and write it as a run folder `out` with one checkpoint (step 0)."""
    hf_folder, out = Path(hf_folder), Path(out)
    _check_free(out)
    model_cfg, state, tokenizer = import_hf(hf_folder)
    special = read_hf_special_tokens(hf_folder, tokenizer)  # every token file read and checked before writing
    cfg = Config(model=model_cfg, data=DataConfig(end_token=special.end))
    tied = {"lm_head.weight"} if model_cfg.tie_embeddings else set()  # a tied head is stored once
    weights = {name: t.contiguous() for name, t in state.items() if name not in tied}
    config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    files = {"config.yaml": config_yaml.encode(), "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
             **special.files}  # its chat template, stop tokens, generation defaults
    lock = FolderLock(out, "importing")
    try:
        _check_free(out)  # again, now that no other process can be writing it

        def write(folder: Path) -> None:
            for name, content in files.items():  # the run folder's copies; the checkpoint holds its own
                (folder / name).write_bytes(content)
            write_weights_checkpoint(folder / CHECKPOINT_DIR / "step_0000000", weights,
                                     {"step": 0, "imported_from": str(hf_folder.resolve())}, files)

        write_staged(out, write)
    finally:
        lock.release()
    return out
