"""The `lmforge` subcommands, one cmd_* each: glue from the parsed command line to the packages
that do the work, and `main`. User errors print one line and exit with status 2, as do a failed
write (OSError) and memory that cannot be allocated; numeric options were checked as they were
read (arguments.number), a config by config/validate.py."""

import os
import signal
import sys
from pathlib import Path

from lmforge.cli.launch import launch_train, quiet_rank, resume_command, retain_freed_memory
from lmforge.cli.parser import build_parser, parse_args
from lmforge.cli.eval_command import cmd_eval
from lmforge.cli.plan_command import cmd_plan
from lmforge.cli.report_command import cmd_report
from lmforge.cli.run_config import finetune_config, resumed_config, resumed_finetune_config, train_config
from lmforge.cli.scaling import cmd_scaling
from lmforge.common.errors import LmforgeError, memory_error_message, os_error_message, warn
from lmforge.common.last_word import say_error, say_last
from lmforge.config import DEFAULT_PRESET, make_config


def cmd_prepare(args) -> int:
    from lmforge.data.prepare import prepare_data

    cfg = make_config(args.model or DEFAULT_PRESET, args.config, args.overrides)
    data = prepare_data(cfg, progress=sys.stderr.isatty())  # no progress bar in a log
    meta = data.meta
    splits = meta["splits"]
    print(f"{data.dir}: tokenizer.json ({meta['tokenizer_vocab_size']} tokens), "
          f"train.bin ({splits['train']['tokens']:,} tokens), val.bin ({splits['val']['tokens']:,} tokens)")
    return 0


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
        retain_freed_memory()  # process-wide malloc tuning, chosen here (cli/launch.py says why)
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


def cmd_generate(args) -> int:
    from lmforge.generate.sampling import KVCache
    from lmforge.generate.texts import print_samples, print_stats, prompt_ids, samples

    loaded, special, constrained = _sampling_model(args, args.dtype)
    model, tokenizer, end = loaded.model, loaded.tokenizer, special.end_id
    # one cache for every sample, for the prompt and the new tokens (never the model's whole context)
    positions = len(prompt_ids(tokenizer, args.prompt, end)) + args.max_new_tokens
    cache = None if args.no_cache else KVCache.for_model(model, positions)
    texts = samples(model, tokenizer, args.prompt, end, args.max_new_tokens, num_samples=args.num_samples,
                    seed=args.seed, constrained=constrained, stops=special.stop_ids, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_cache, cache=cache)
    print_samples(texts, args.num_samples)
    if args.stats:
        print_stats(loaded.model, cache, loaded.source)
    return 0


def cmd_chat(args) -> int:
    from lmforge.generate.chat import ChatSession, run_chat, sampling_options

    loaded, special, constrained = _sampling_model(args)
    sampling = sampling_options(special, args.temperature, args.top_k, args.top_p)
    session = ChatSession(loaded.model, loaded.tokenizer, special, args.max_new_tokens, system=args.system,
                          constrained=constrained, seed=args.seed, **sampling)
    return run_chat(session, Path(args.run).name)


def _sampling_model(args, dtype: str = "auto"):
    """generate's and chat's model on --device: a run folder (a LoRA run: its base + adapters) or a
    Hugging Face folder, in its stored dtype by default; with --adapter, a PEFT adapter on top. Also
    its special tokens and the --format json decoder (None without --format)."""
    from lmforge.generate.load import load_for_sampling
    from lmforge.parallel.world import resolve_device

    json_answer = _json_answer(args)  # before loading the model: a bad --schema stops at once
    device = resolve_device(args.device, setting="--device")
    loaded, special = load_for_sampling(args.run, args.adapter, args.merge, dtype, device, warn=warn)
    if json_answer is None:
        return loaded, special, None
    from lmforge.structured.constrain import JsonMode

    return loaded, special, JsonMode(loaded.tokenizer, special.end_id, *json_answer)


def _json_answer(args):
    """--format json (and --schema): the schema (or None) and grammar each answer must match; None
    without --format."""
    if args.format is None and args.schema is None:
        return None
    from lmforge.structured.constrain import CONSTRAINED_FORMATS, json_grammar, load_schema

    if args.format is None:
        raise LmforgeError("--schema needs --format json")
    if args.format not in CONSTRAINED_FORMATS:
        raise LmforgeError(f"--format {args.format}: constrained decoding supports "
                           f"{', '.join(CONSTRAINED_FORMATS)} (the grammar engine has no YAML or XML grammar)")
    schema = load_schema(args.schema) if args.schema else None
    return schema, json_grammar(schema)


def cmd_runs(args) -> int:
    from lmforge.runs.listing import find_runs, plot_runs, print_runs
    from lmforge.common.folders import write_file_staged

    if args.plot is None:
        print_runs(find_runs(args.dir), args.dir)
        return 0
    write_file_staged(Path(args.out), lambda path: plot_runs(args.dir, args.plot, path))
    print(f"loss curves: {args.out}")
    return 0


def cmd_export(args) -> int:
    from lmforge.runs.folders import export_run

    out = export_run(args.run, args.out, args.format)
    if args.format == "peft":
        print(f"{out}: a PEFT LoRA adapter; load it with peft.PeftModel.from_pretrained(<the base, exported with "
              f"--format hf from the base run>, {str(out)!r})")
    else:
        print(f"{out}: a Hugging Face folder; load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_import_hf(args) -> int:
    from lmforge.runs.folders import import_run

    out = Path(args.out) if args.out else Path("runs") / (args.name or Path(args.folder).resolve().name)
    import_run(args.folder, out)
    print(f"{out}: imported; try lmforge generate {out} --prompt \"...\"")
    return 0


def cmd_tasks(args) -> int:
    import json

    from lmforge.common.folders import write_file_staged
    from lmforge.structured.tasks import TRAINING_MIX, training_documents

    out = Path(args.out)
    if not out.parent.is_dir():
        raise LmforgeError(f"--out {out}: folder {out.parent} does not exist; create it or pick another path")
    docs = training_documents(args.n, args.seed)
    text = "".join(json.dumps({"text": doc}) + "\n" for doc in docs)
    write_file_staged(out, lambda path: path.write_text(text, encoding="utf-8"))  # whole or not at all
    mix = ", ".join(f"{share:.0%} {name}" for name, share in TRAINING_MIX.items())
    print(f"{out}: {len(docs):,} documents ({mix}), seed {args.seed}")
    return 0


def cmd_eval_format(args) -> int:
    from lmforge.structured.evaluate import RESULT_FILES, conditions, run_study, study_plan

    words = {name: [word.strip() for word in getattr(args, name).split(",") if word.strip()]
             for name in ("kinds", "modes", "formats")}
    conds = conditions(words["modes"], words["formats"])
    if not conds:
        raise LmforgeError("nothing to evaluate: give at least one mode (and a format for modes other than free)")
    tasks = study_plan(words["kinds"], args.tasks, args.seed)
    from lmforge.runs.load import model_folder

    kind, _ = model_folder(args.run)  # a run folder or a Hugging Face folder, else one line
    if kind == "hf" and not args.out:
        raise LmforgeError(f"{args.run} is a Hugging Face folder: give --out for the results (lmforge writes "
                           f"nothing into a model's folder)")
    out = Path(args.out) if args.out else Path(args.run) / "eval-format"
    # the results replace `out` whole (common/folders.py): a folder holding anything else is not ours to replace
    others = sorted(p.name for p in out.iterdir() if p.name not in RESULT_FILES) if out.is_dir() else []
    if others or out.exists() and not out.is_dir():
        raise LmforgeError(f"--out {out} holds {', '.join(others) or 'a file'}, not only eval-format's results: "
                           f"use a new folder")
    run_study(args.run, tasks, conds, out, args.max_new_tokens, args.device, progress=not args.no_progress)
    print(f"results: {out}/table.md, {out}/results.png, {out}/results.jsonl")
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "finetune": cmd_finetune, "generate": cmd_generate,
            "chat": cmd_chat,
            "plan": cmd_plan, "runs": cmd_runs, "export": cmd_export, "import-hf": cmd_import_hf, "tasks": cmd_tasks,
            "eval-format": cmd_eval_format, "scaling": cmd_scaling, "eval": cmd_eval, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parse_args(parser, argv)
    args.argv = argv  # what `train --nproc` hands to torchrun
    if args.command is None:
        parser.print_help()
        return 0
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled below
        return status
    except LmforgeError as err:
        if not quiet_rank(err):
            say_error(str(err))
        return 2
    except BrokenPipeError:
        # Whoever read our output stopped (`lmforge plan --json | head`): stop quietly, as cat does,
        # with the status of a process killed by SIGPIPE. Python's exit flush must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:  # a full disk, a read-only folder: the machine's state, not a bug
        say_error(os_error_message(err))
        return 2
    except (MemoryError, RuntimeError) as err:  # more memory than there is: one line; any other RuntimeError is a bug
        message = memory_error_message(err)
        if message is None:
            raise
        say_error(message)
        return 2
    except KeyboardInterrupt:
        print("\nlmforge: interrupted", file=sys.stderr)
        return 130
