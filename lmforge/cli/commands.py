"""The `lmforge` subcommands, one cmd_* each: glue from the parsed command line to the packages
that do the work (train and finetune: training.py), the table of every subcommand, its parser and
`main`. User errors print one line and exit with status 2, as do a failed
write (OSError) and memory that cannot be allocated; numeric options were checked as they were
read (arguments.number), a config by config/validate.py."""

import argparse
import os
import signal
import sys
from pathlib import Path

from lmforge.cli.arguments import EXAMPLES, RAW, Parser, add_finetune, add_prepare, add_train, parse_args
from lmforge.cli.eval_command import cmd_eval
from lmforge.cli.launch import quiet_rank
from lmforge.cli.options import (add_chat, add_eval, add_eval_format, add_export, add_generate, add_import_hf,
                                 add_report, add_runs, add_tasks)
from lmforge.cli.plan_command import cmd_plan
from lmforge.cli.plan_parser import add_plan
from lmforge.cli.scaling import add_scaling, cmd_scaling
from lmforge.cli.training import cmd_finetune, cmd_train
from lmforge.common.errors import LmforgeError, memory_error_message, os_error_message, warn
from lmforge.common.last_word import say_error
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
    from lmforge.runs.load import results_folder

    out = results_folder(args.run, args.out, "eval-format")
    # the results replace `out` whole (common/folders.py): a folder holding anything else is not ours to replace
    others = sorted(p.name for p in out.iterdir() if p.name not in RESULT_FILES) if out.is_dir() else []
    if others:
        raise LmforgeError(f"--out {out} holds {', '.join(others)}, not only eval-format's results: use a new folder")
    run_study(args.run, tasks, conds, out, args.max_new_tokens, args.device, progress=not args.no_progress)
    print(f"results: {out}/table.md, {out}/results.png, {out}/results.jsonl")
    return 0


def cmd_report(args) -> int:
    from lmforge.train.run_report import write_report

    print(f"wrote {write_report(args.run)}")
    return 0


# Each subcommand: its one-line help (all that `lmforge --help` lists), the function that adds its
# options and the one that runs it
SUBCOMMANDS = {
    "prepare": ("train the tokenizer and write train.bin/val.bin", add_prepare, cmd_prepare),
    "train": ("train a model (prepares the data first if needed)", add_train, cmd_train),
    "finetune": ("fine-tune a trained model on your data, fully or with LoRA adapters", add_finetune, cmd_finetune),
    "generate": ("sample text from a trained run or a Hugging Face model", add_generate, cmd_generate),
    "chat": ("talk to a model on its chat template, replies streamed", add_chat, cmd_chat),
    "plan": ("predict FLOPs, memory per device and time for a setup, before running it", add_plan, cmd_plan),
    "runs": ("compare the runs in a folder: settings, progress, loss, speed, status", add_runs, cmd_runs),
    "export": ("write a run's model in another format: a Hugging Face folder", add_export, cmd_export),
    "import-hf": ("read a Hugging Face Llama or GPT-2 folder into a run folder", add_import_hf, cmd_import_hf),
    "tasks": ("write training documents of the structured-output task set (.jsonl)", add_tasks, cmd_tasks),
    "eval-format": ("accuracy of a model's answers in free text, JSON, YAML, XML, constrained or converted",
                    add_eval_format, cmd_eval_format),
    "scaling": ("train an IsoFLOP sweep and fit a scaling law to it", add_scaling, cmd_scaling),
    "eval": ("score a model on standard benchmarks (ARC, HellaSwag, GSM8K, HumanEval, ...)", add_eval, cmd_eval),
    "report": ("write report.md about a run: config, data, cost, loss curves, scores, sample", add_report, cmd_report),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `argv` of the one it names only (the others listed by
    their help line): a command line is read by one subcommand's options."""
    parser = Parser(
        prog="lmforge", description="Build language models from scratch and know what every step costs.",
        epilog=EXAMPLES, formatter_class=RAW)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, add, _) in SUBCOMMANDS.items():
        subcommand = commands.add_parser(name, help=help)
        if argv is None or argv[:1] == [name]:
            add(subcommand)
    # parse_args looks up the subcommand's parser: its RUN argument, and which of its options a misspelt one resembles
    parser.subcommands = commands.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parse_args(parser, argv)
    args.argv = argv  # what `train --nproc` hands to torchrun
    if args.command is None:
        parser.print_help()
        return 0
    try:
        status = SUBCOMMANDS[args.command][2](args)
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
