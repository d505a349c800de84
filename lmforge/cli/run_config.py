"""The config and run folder of a training: a new run, a resumed one, or a fine-tuning of a base.

These read the parsed command line (the options train and finetune share); the config itself is
built and checked by lmforge/config."""

import os
import time
from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.config import (DEFAULT_PRESET, Config, apply_dict, load_config, make_config, parse_override, read_yaml,
                            resume_may_change, set_value, validate)

# Fine-tuning starts from a trained model: fewer steps, a short warmup and a lower peak rate than
# training from scratch (each can be overridden).
FINETUNE_DEFAULTS = ("train.max_steps=200", "optim.warmup_steps=20", "optim.lr=1e-3", "train.eval_interval=50",
                     "train.checkpoint_interval=100")


def new_run_folder(args, default_name: str) -> Path:
    """--out, or runs/NAME with --name or `default_name` and the time."""
    if args.out:
        return Path(args.out)
    return Path("runs") / (args.name or f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}")


def train_config(args):
    """The config of a new `lmforge train` run (preset, --config, overrides) and its folder."""
    preset = args.model or DEFAULT_PRESET
    return make_config(preset, args.config, args.overrides), new_run_folder(args, preset)


def resumed_config(args):
    """The config of the run named by --resume, with the overrides a resume may make applied
    (config.resume_may_change: train.*, optim.* but optim.name, parallel.*, data.dir)."""
    if args.config or getattr(args, "model", None) or getattr(args, "base", None) or args.name or args.out:
        raise LmforgeError("--resume takes its config from the run; only train.*, optim.*, parallel.* and data.dir "
                           "overrides may be added")
    run_dir = Path(args.resume)
    if not (run_dir / "config.yaml").is_file():
        raise LmforgeError(f"{run_dir} is not a run folder (no config.yaml)")
    from lmforge.runs.folders import check_not_imported

    check_not_imported(run_dir)  # a model imported from Hugging Face is not a run to resume
    cfg = load_config(run_dir / "config.yaml")
    for item in args.overrides:
        key, value = parse_override(item)
        if key == "optim.name" and value != cfg.optim.name:
            raise LmforgeError(f"cannot change optim.name when resuming: {run_dir} holds the states of "
                               f"optim.name={cfg.optim.name}; start a new run (or finetune {run_dir}) for {value}")
        if not resume_may_change(key):
            raise LmforgeError(f"cannot change {key} when resuming: only train.*, optim.*, parallel.* and data.dir "
                               f"settings may change")
        set_value(cfg, key, value, origin="command line")
    validate(cfg)
    return cfg, run_dir


def resumed_finetune_config(args):
    """`lmforge finetune --resume RUN`: resumed_config, for a fine-tuning run with no new LoRA settings."""
    if any(value is not None for value in (args.lora_rank, args.lora_alpha, args.lora_targets, args.lora_dropout,
                                           args.adapter)):
        raise LmforgeError("--resume takes its LoRA settings from the run; only train.* and optim.* overrides "
                           "may be added")
    cfg, run_dir = resumed_config(args)
    if cfg.finetune.base is None:
        raise LmforgeError(f"{run_dir} is not a fine-tuning run: continue it with lmforge train --resume {run_dir}")
    return cfg, run_dir


def finetune_config(args):
    """The config of a new fine-tuning of the run (or Hugging Face folder) args.base: the base's model
    and end token, FINETUNE_DEFAULTS, the LoRA options, then --config and the overrides."""
    if args.base is None:
        raise LmforgeError("lmforge finetune needs RUN (the run folder of the model to fine-tune)")
    for item in args.overrides:
        key, _ = parse_override(item)
        if key.startswith(("model.", "finetune.base")):
            raise LmforgeError(f"cannot set {key}: a fine-tuning run keeps its base's model (use --base)")
    from lmforge.data.corpus import absolute_source
    from lmforge.runs.load import base_settings, model_folder
    from lmforge.train.finetune import fitting_seq_len

    base = model_folder(args.base)[1].resolve()  # a hub cache's models--org--name: its snapshot
    base_model, end_token, tokenizer = base_settings(base)  # an lmforge run folder or a Hugging Face folder
    lora = {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "lora_targets": args.lora_targets,
            "lora_dropout": args.lora_dropout}
    if args.adapter is not None:  # a PEFT adapter to continue: its settings, checked against the base
        from lmforge.interop.peft import peft_settings

        if any(lora[key] is not None for key in ("lora_rank", "lora_alpha", "lora_targets")):
            raise LmforgeError("--adapter takes its rank, alpha and targets from the adapter: leave out --lora-rank, "
                               "--lora-alpha and --lora-targets")
        adapter = Path(args.adapter).resolve()
        lora = {**peft_settings(adapter, base_model), "adapter": str(adapter),
                **({"lora_dropout": args.lora_dropout} if args.lora_dropout is not None else {})}
    flags = [f"finetune.{key}={value}" for key, value in lora.items() if value is not None]
    # make_config's steps, with the base's model in place first: train.seq_len is checked against its positions
    cfg = Config(model=base_model)
    if args.config:
        apply_dict(cfg, read_yaml(args.config), origin=args.config)
        cfg.model = base_model
    for item in [*FINETUNE_DEFAULTS, f"finetune.base={base}", *flags, *args.overrides]:
        set_value(cfg, *parse_override(item), origin="command line")
    cfg.data.end_token = end_token  # the base's own end-of-document token
    cfg.data.source = absolute_source(cfg.data.source)  # read again on resume, from wherever it is run
    if cfg.train.seq_len is None:  # examples: as long as the longest, not the model's maximum
        fitted = fitting_seq_len(cfg, tokenizer)
        if fitted is not None:
            cfg.train.seq_len, why = fitted
            if os.environ.get("RANK", "0") == "0":
                print(why)
    validate(cfg)
    if cfg.optim.decay_steps is None:  # a new config: the schedule's length is fixed now (as make_config does)
        cfg.optim.decay_steps = cfg.train.max_steps
    kind = f"lora{cfg.finetune.lora_rank}" if cfg.finetune.lora_rank else "full"
    return cfg, new_run_folder(args, f"{base.name}-{kind}")
