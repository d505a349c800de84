"""`lmforge train` and `lmforge finetune` in this process: the config and run folder of a new run, a
resumed one or a fine-tuning of a base (read from the parsed command line; the config itself is built
and checked by lmforge/config), the trainer run, the command that continues it as it was launched, and
the host-memory settings a training process starts with (`retain_freed_memory`). `--nproc N` hands
the command line to launch.py."""

import ctypes
import ctypes.util
import os
import shlex
import sys
import time
from pathlib import Path

from lmforge.cli.launch import NPROC_ENV, launch_train
from lmforge.common.errors import LmforgeError, os_error_message
from lmforge.common.last_word import say_last
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


def cmd_train(args) -> int:
    cfg, run_dir = resumed_config(args) if args.resume else train_config(args)
    if args.nproc is not None:
        return launch_train(args, cfg, run_dir)
    return _run_trainer(cfg, run_dir, args, "train")


def cmd_finetune(args) -> int:
    from lmforge.accounting.hardware import this_device
    from lmforge.train.finetune import check_step_fits

    cfg, run_dir = resumed_finetune_config(args) if args.resume else finetune_config(args)
    check_step_fits(cfg, this_device)  # before the base or the data is read: a step that cannot fit stops here
    if args.nproc is not None:
        return launch_train(args, cfg, run_dir)
    return _run_trainer(cfg, run_dir, args, "finetune")


def _run_trainer(cfg, run_dir: Path, args, command: str) -> int:
    from lmforge.accounting.hardware import this_device
    from lmforge.parallel.world import resolve_device
    from lmforge.runs.checkpoint.find import list_checkpoints
    from lmforge.train.loop import Trainer
    from lmforge.train.signals import Stopped

    if resolve_device(cfg.train.device).type == "cpu":
        retain_freed_memory()  # process-wide malloc tuning, chosen here (retain_freed_memory says why)
    # the measured matmul peak behind MFU, cached per machine (lmforge plan --hardware this --remeasure)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress, machine=this_device)
    resume = resume_command(command, run_dir)  # as this run was launched (one process, --nproc, torchrun)
    try:
        trainer.run()
    except Stopped as stop:  # SIGTERM or a first Ctrl-C: the step finished and was saved (by all ranks)
        if trainer.world.is_main:
            print(file=sys.stderr)  # the progress bar's line ends; under torchrun the line comes after its traceback
            say_last(f"lmforge: {stop}; saved {stop.checkpoint}; continue with: {resume}")
        return stop.exit_status
    except KeyboardInterrupt:  # a second Ctrl-C: no save
        if trainer.world.is_main:
            print(file=sys.stderr)
            say_last(f"lmforge: interrupted at step {trainer.step}; continue from the last checkpoint with: {resume}")
        return 130
    except OSError as err:
        if not list_checkpoints(run_dir):
            raise
        raise LmforgeError(f"{os_error_message(err)}; then continue from the last checkpoint with: {resume}") from None
    return 0


def resume_command(command: str, run_dir: Path) -> str:
    """The command that continues `run_dir` when launched as this process was: `lmforge COMMAND
    --resume RUN` for one process, with `--nproc N` under `lmforge train --nproc N`, and under
    torchrun its options (read from the agent's command line, this process's parent) before
    `-m lmforge COMMAND --resume RUN`."""
    if "WORLD_SIZE" not in os.environ:
        return f"lmforge {command} --resume {shlex.quote(str(run_dir))}"
    if os.environ.get(NPROC_ENV):
        return f"lmforge {command} --nproc {os.environ[NPROC_ENV]} --resume {shlex.quote(str(run_dir))}"
    options = _torchrun_options(command)
    if options is None:  # no /proc: what the environment says
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        options = [f"--nnodes={int(os.environ['WORLD_SIZE']) // max(local, 1)}", f"--nproc_per_node={local}", "..."]
    line = shlex.join(["torchrun", *options, "-m", "lmforge", command, "--resume", str(run_dir)])
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    return line + (f" (on each of the {nodes} nodes, with its own torchrun options)" if nodes > 1 else "")


def _torchrun_options(command: str) -> list[str] | None:
    """torchrun's options on its command line (the parent of this rank), without the entry point
    (`-m lmforge`, or a script `.../lmforge`) and what follows it; None where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            words = [word.decode(errors="replace") for word in f.read().split(b"\0") if word]
    except OSError:
        return None
    for i in range(1, len(words)):
        if words[i] == command and Path(words[i - 1]).name == "lmforge":
            entry = i - 1 - (words[i - 2] in ("-m", "--module") if i >= 2 else 0)
            break
    else:
        return None
    # skip the launcher itself: `python -m torch.distributed.run`, `python .../torchrun`, `torchrun`
    start = next((j + 1 for j, word in enumerate(words[:entry])
                  if word in ("torch.distributed.run", "torch.distributed.launch") or Path(word).name == "torchrun"),
                 None)
    if start is None:
        return None
    return [word for word in words[start:entry] if word not in ("--no-python", "--no_python")]


# Freed host memory is kept mapped in the process (Linux, glibc), so training steps stop re-faulting it.
#
# PyTorch's CPU tensors come from malloc. glibc serves large blocks with fresh mmap() calls, unmaps
# them when they are freed, and trims the top of its heap; a training step frees and re-allocates the
# same large activations every step, so the kernel maps and zeroes those pages again, one fault per
# 4 KiB page. On the default config that is 39-43k minor page faults and ~70 ms of kernel time per
# 0.5 s step. Serving every block from the heap (M_MMAP_MAX = 0: no block gets an mmap of its own,
# whatever its size), growing the heap in large steps (M_TOP_PAD) and never trimming it keeps the
# pages (`bench/throughput.py` prints faults per step; bench/RESULTS.md). This first raised the
# mmap threshold to its ceiling, 32 MiB, instead: 14-19k faults per step on the default config and
# 4-5% faster steps than glibc's defaults, but blocks above 32 MiB still got an mmap of their own
# whenever the heap's free space ran short, and at GPT-2's vocabulary the logits (1024 x 50257
# fp32: 206 MB), their gradient and the embedding's (154 MB) are such blocks. With M_MMAP_MAX = 0,
# measured beside the threshold alone: 1.3k instead of 14k faults per step and 1.05x on the default
# config, 61k instead of 359k and 1.11x on a 4-layer GPT-2 shape (bench/RESULTS.md, issue 15).
#
# The cost is that the process keeps its peak memory until it exits, as a training process does
# anyway, plus what fragments of the heap cannot be reused for the next step's large blocks: on
# the 4-layer GPT-2 shape above the peak resident memory rose from 2.3 to 3.1 GB (the default
# config's did not move).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's <malloc.h>
MALLOC_SETTINGS = {M_MMAP_MAX: 0, M_TOP_PAD: 512 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1}


def retain_freed_memory() -> bool:
    """Apply the settings above; False (and nothing changed) where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # present in glibc only (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(option, value) == 1 for option, value in MALLOC_SETTINGS.items())
