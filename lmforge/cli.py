"""The `lmforge` command: prepare data, train, generate, plan, compare runs, evaluate answer formats.

Every subcommand that takes a config accepts `--config FILE.yaml`, `--model PRESET` and
`section.key=value` overrides, in any order. User errors print one line and exit with status 2.
Building the parser imports no torch, so that `lmforge --help` answers at once.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from lmforge.config import (DEFAULT_PRESET, MODEL_PRESETS, _did_you_mean, load_config, make_config, parse_override,
                            set_value, validate)
from lmforge.errors import LmforgeError, os_error_message
from lmforge.model.backends import BACKENDS
from lmforge.precision.policies import ALIASES, POLICIES
from lmforge.recompute_modes import RECOMPUTE_MODES

EXAMPLES = """\
examples:
  lmforge train                                      # default model on the embedded corpus, ~10 min on CPU
  lmforge train --model tiny train.max_steps=50      # presets: {presets}
  lmforge train --config my.yaml model.n_layers=8 train.max_steps=2000
  lmforge train --resume runs/<name>                 # continue where the run stopped
  lmforge generate --run runs/<name> --prompt "def fib(" --max-new-tokens 100
  lmforge plan --model llama3-8b --batch-size 1 --seq-len 8192 --precision bf16-mixed --hardware h100-sxm
  lmforge runs                                       # the runs in runs/ side by side
""".format(presets=", ".join(MODEL_PRESETS))


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML file with model/data/optim/train sections")
    parser.add_argument("--model", metavar="PRESET", default=None,
                        help=f"model preset (default {DEFAULT_PRESET}): {', '.join(MODEL_PRESETS)}")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. model.n_layers=8 train.max_steps=2000 optim.lr=1e-3")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge", description="Build language models from scratch and know what every step costs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    prepare = commands.add_parser("prepare", help="train the tokenizer and write train.bin/val.bin",
                                  description="Gather the corpus, split it by document, train a byte-level "
                                              "BPE tokenizer and write token files to data.dir.")
    _add_config_args(prepare)

    train = commands.add_parser("train", help="train a model (prepares the data first if needed)",
                                description="Train a model; writes checkpoints, metrics.jsonl, loss.png, "
                                            "summary.json and sample.txt into the run folder.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(train)
    train.add_argument("--name", help="run name: the run folder is runs/NAME (default: preset and time)")
    train.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")
    train.add_argument("--resume", metavar="RUN", help="continue the run in folder RUN from its latest checkpoint; "
                                                       "only train.* and optim.* may be overridden")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")

    gen = commands.add_parser("generate", help="sample text from a trained run",
                              description="Continue a prompt with the latest checkpoint of a run.")
    gen.add_argument("--run", required=True, metavar="RUN", help="run folder, e.g. runs/small-20261130-120000")
    gen.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1 disables)")
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole context every token")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    gen.add_argument("--format", metavar="FMT", help="constrain the answer to FMT while decoding: json "
                                                    "(prints only the answer; exit 2 if it is cut by --max-new-tokens)")
    gen.add_argument("--schema", metavar="FILE", help="JSON Schema the --format json answer must match")

    plan = commands.add_parser(
        "plan", help="predict FLOPs, memory per device and time for a setup, before running it",
        description="Print what a training setup costs: parameters, FLOPs per token and per step, memory per "
                    "device with its breakdown (and whether it fits), and time per step at an assumed MFU. "
                    "Batch, sequence, precision, recompute and attention default to the config's values.",
        epilog="examples:\n"
               "  lmforge plan                                   # the default model on this machine\n"
               "  lmforge plan --model gpt3-175b --batch-size 128 --seq-len 2048 --precision fp16 --recompute none --json\n"
               "  lmforge plan --model llama3-70b --batch-size 1 --seq-len 8192 --precision bf16-mixed \\\n"
               "      --zero-stage 3 --dp 64 --recompute full --hardware h100-sxm --tokens 15e12 --plot plan.png\n"
               "  lmforge plan --dtypes",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(plan)
    plan.add_argument("--batch-size", type=int, help="sequences per micro-batch per data-parallel rank")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence")
    plan.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    plan.add_argument("--precision", help=f"{', '.join(POLICIES)} (or {aliases})")
    plan.add_argument("--optimizer", default="adamw", help="adamw, sgd-momentum or sgd (default adamw)")
    plan.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3 (shards over --dp)")
    plan.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with sequence parallelism)")
    plan.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (1F1B)")
    plan.add_argument("--recompute", help=f"activation recomputation: {', '.join(RECOMPUTE_MODES)}")
    plan.add_argument("--attention", help=f"{', '.join(BACKENDS)} (naive keeps the s x s scores, the others do not)")
    plan.add_argument("--fp32-attention", action="store_true", default=None,
                      help="attention core in fp32 under a low-precision policy (train.fp32_attention)")
    plan.add_argument("--hardware", default="this",
                      help="this (measure this machine) or one of: a100, h100-sxm, h100-pcie, h200, b200, l4, "
                           "rtx4090, mi300x")
    plan.add_argument("--mfu", type=float, default=0.5, help="MFU assumed for the time estimate (default 0.5)")
    plan.add_argument("--tokens", type=float, help="token budget to estimate the total training time for")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--plot", metavar="PNG", help="save a bar chart of the memory breakdown")
    plan.add_argument("--dtypes", action="store_true", help="print the table of floating-point formats and exit")
    plan.add_argument("--remeasure", action="store_true", help="with --hardware this: measure the matmul peak again")

    runs = commands.add_parser(
        "runs", help="compare the runs in a folder: settings, progress, loss, speed, status",
        description="List the runs in DIR (default runs) with their model, precision, batch, steps done, final "
                    "validation loss, tokens/s, MFU and status (running, finished or stopped); with --plot, draw "
                    "their loss curves on one figure.",
        epilog="examples:\n"
               "  lmforge runs                                   # every run in runs/\n"
               "  lmforge runs --plot small-a small-b --out cmp.png\n"
               "  lmforge runs experiments/ --plot                # every run in experiments/ on one figure",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    runs.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="folder holding run folders (default runs)")
    runs.add_argument("--plot", nargs="*", metavar="RUN",
                      help="draw the loss curves of these runs (names in DIR or paths; none: all of DIR)")
    runs.add_argument("--out", metavar="PNG", default="runs.png", help="where --plot saves its figure (default runs.png)")
    tasks = commands.add_parser(
        "tasks", help="write training documents of the structured-output task set (.jsonl)",
        description="Write N training documents of lmforge's task set (lmforge/structured/tasks.py: last letters, "
                    "addition, counting, sentiment, extraction; train split only) as {\"text\": ...} lines: 40%% "
                    "free-text replies, 40%% JSON/YAML/XML replies (both key orders), 20%% free replies converted "
                    "to a format. Train on them with: lmforge train data.source=FILE ...")
    tasks.add_argument("--out", required=True, metavar="FILE", help="the .jsonl file to write")
    tasks.add_argument("-n", type=int, default=20000, help="number of documents (default 20000)")
    tasks.add_argument("--seed", type=int, default=0)

    evalf = commands.add_parser(
        "eval-format", help="accuracy of a model's answers in free text, JSON, YAML, XML, constrained or converted",
        description="Run the test split of the task set on a model under free text, format instructions "
                    "(JSON, YAML, XML; reasoning-first and answer-first), constrained decoding and "
                    "answer-then-convert; print accuracy and parse-error rate per task and condition with 95%% "
                    "Wilson intervals, and write results.jsonl, table.md, summary.json and results.png to --out.")
    evalf.add_argument("model", metavar="RUN", help="an lmforge run folder")
    evalf.add_argument("--tasks", type=int, default=20, help="tasks of each kind (default 20)")
    evalf.add_argument("--seed", type=int, default=0, help="which test tasks are drawn (default 0)")
    evalf.add_argument("--kinds", default="last_letters,addition,counting,sentiment,extraction",
                       help="comma-separated task kinds (default all five)")
    evalf.add_argument("--modes", default="free,instructed,constrained,converted",
                       help="comma-separated: free, instructed, constrained, converted (default all)")
    evalf.add_argument("--formats", default="json,yaml,xml", help="comma-separated: json, yaml, xml (default all)")
    evalf.add_argument("--max-new-tokens", type=int, default=160, help="per reply (default 160)")
    evalf.add_argument("--out", metavar="DIR", help="where the results go (default RUN/eval-format)")
    evalf.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evalf.add_argument("--no-progress", action="store_true", help="no progress bar")

    # main() looks up the subcommand's parser to say which of its options a misspelt one resembles
    parser.subcommands = commands.choices
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse options and `section.key=value` overrides given in any order.

    argparse fills a nargs="*" positional from one run of bare words only, so in
    `train a.b=1 --model tiny c.d=2` it hands `c.d=2` back as unknown; those words join the overrides
    here, in the order typed (a later override wins). An unknown --option is still an error."""
    args, extras = parser.parse_known_args(argv)
    unknown = [word for word in extras if word.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        subcommand = parser.subcommands.get(args.command, parser)
        options = [option for action in subcommand._actions for option in action.option_strings]
        hint = _did_you_mean(unknown[0], options) if unknown[0].startswith("-") else ""
        subcommand.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        commands = {"prepare": cmd_prepare, "train": cmd_train, "generate": cmd_generate, "plan": cmd_plan,
                    "runs": cmd_runs, "tasks": cmd_tasks, "eval-format": cmd_eval_format}
        status = commands[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled below
        return status
    except LmforgeError as err:
        print(f"lmforge: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whoever read our output stopped (`lmforge plan --json | head`): stop quietly, as cat does,
        # with the status of a process killed by SIGPIPE. Python's exit flush must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:  # a full disk, a read-only folder: the machine's state, not a bug
        print(f"lmforge: error: {os_error_message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlmforge: interrupted", file=sys.stderr)
        return 130


def cmd_prepare(args) -> int:
    from lmforge.data.prepare import prepare_data

    cfg = make_config(args.model or DEFAULT_PRESET, args.config, args.overrides)
    data = prepare_data(cfg)
    meta = data.meta
    print(f"{data.dir}: tokenizer.json ({meta['tokenizer_vocab_size']} tokens), "
          f"train.bin ({meta['splits']['train']['tokens']:,} tokens), val.bin ({meta['splits']['val']['tokens']:,} tokens)")
    return 0


def cmd_train(args) -> int:
    from lmforge.accounting.hardware import this_device
    from lmforge.train.checkpoint import list_checkpoints
    from lmforge.train.host_memory import retain_freed_memory
    from lmforge.train.loop import Trainer
    from lmforge.train.setup import resolve_device
    from lmforge.train.signals import Stopped

    if args.resume:
        if args.config or args.model or args.name or args.out:
            raise LmforgeError("--resume takes its config from the run; only train.* and optim.* overrides may be added")
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise LmforgeError(f"{run_dir} is not a run folder (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml")
        for item in args.overrides:
            key, value = parse_override(item)
            if not key.startswith(("train.", "optim.")):
                raise LmforgeError(f"cannot change {key} when resuming: only train.* and optim.* settings may change")
            set_value(cfg, key, value, origin="command line")
        validate(cfg)
    else:
        preset = args.model or DEFAULT_PRESET
        cfg = make_config(preset, args.config, args.overrides)
        if args.out:
            run_dir = Path(args.out)
        else:
            run_dir = Path("runs") / (args.name or f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if resolve_device(cfg.train.device).type == "cpu":
        retain_freed_memory()  # process-wide malloc tuning, chosen here (train/host_memory.py says why)
    # the measured matmul peak behind MFU, cached per machine (lmforge plan --hardware this --remeasure)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress, machine=this_device)
    resume = f"lmforge train --resume {run_dir}"
    try:
        trainer.run()
    except Stopped as stop:  # SIGTERM or a first Ctrl-C: the step finished and was saved
        print(f"\nlmforge: {stop}; saved {stop.checkpoint}; continue with: {resume}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # a second Ctrl-C: no save
        print(f"\nlmforge: interrupted at step {trainer.step}; continue from the last checkpoint with: "
              f"{resume}", file=sys.stderr)
        return 130
    except OSError as err:
        if not list_checkpoints(run_dir):
            raise
        raise LmforgeError(f"{os_error_message(err)}; then continue from the last checkpoint with: {resume}") from None
    return 0


def cmd_generate(args) -> int:
    from lmforge.data.tokenizer import END_OF_TEXT, load_tokenizer
    from lmforge.generate.sampling import generate
    from lmforge.model.transformer import Transformer
    from lmforge.train import checkpoint as ckpt
    from lmforge.train.setup import resolve_device

    if args.max_new_tokens < 1 or args.temperature < 0 or args.num_samples < 1:
        raise LmforgeError("--max-new-tokens and --num-samples must be >= 1 and --temperature >= 0")
    if args.top_k is not None and args.top_k < 1 or not 0 < args.top_p <= 1:
        raise LmforgeError("--top-k must be >= 1 and --top-p in (0, 1]")
    grammar = schema = None
    if args.format is not None or args.schema is not None:
        from lmforge.structured.constrain import CONSTRAINED_FORMATS, JsonMode, json_grammar, load_schema

        if args.format is None:
            raise LmforgeError("--schema needs --format json")
        if args.format not in CONSTRAINED_FORMATS:
            raise LmforgeError(f"--format {args.format}: constrained decoding supports "
                               f"{', '.join(CONSTRAINED_FORMATS)} (the grammar engine has no YAML or XML grammar)")
        schema = load_schema(args.schema) if args.schema else None
        grammar = json_grammar(schema)
    device = resolve_device(args.device, setting="--device")
    path = ckpt.find_checkpoint(args.run, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))
    cfg = load_config(path / "config.yaml")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    model = Transformer(cfg.model)
    ckpt.load_model_weights(model, path)
    model.to(device)
    end = tokenizer.token_to_id(END_OF_TEXT)
    prompt_ids = tokenizer.encode(args.prompt).ids if args.prompt else [end]
    json_mode = JsonMode(tokenizer, end, schema, grammar) if grammar is not None else None
    for index in range(args.num_samples):
        if json_mode is not None:
            out = json_mode.generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed + index,
                                     use_cache=not args.no_cache)
            if not out.complete:
                raise LmforgeError(f"the answer{f' of sample {index + 1}' if args.num_samples > 1 else ''} was cut "
                                   f"at --max-new-tokens {args.max_new_tokens} before its JSON closed: "
                                   "raise --max-new-tokens")
            if args.num_samples > 1:
                print(f"--- sample {index + 1} ---")
            print(out.text)
            continue
        ids = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, stop_token=end, seed=args.seed + index, use_cache=not args.no_cache)
        if args.num_samples > 1:
            print(f"--- sample {index + 1} ---")
        print(args.prompt + tokenizer.decode(ids))
    return 0


def cmd_plan(args) -> int:
    import json

    import torch
    from rich.console import Console

    from lmforge.accounting.hardware import this_device
    from lmforge.accounting.plan import Setup, make_plan, matmul_dtype
    from lmforge.planning import plot_memory, print_dtypes, print_plan

    console = Console()
    if args.dtypes:
        print_dtypes(console)
        return 0
    cfg = make_config(args.model or DEFAULT_PRESET, args.config, args.overrides)
    if args.seq_len is not None and args.seq_len > cfg.model.max_seq_len:
        raise LmforgeError(f"--seq-len {args.seq_len} is beyond the model's {cfg.model.max_seq_len} positions: "
                           f"lower it, or add model.max_seq_len={args.seq_len}")
    if args.plot and not Path(args.plot).parent.is_dir():
        raise LmforgeError(f"--plot {args.plot}: folder {Path(args.plot).parent} does not exist; create it "
                           f"or pick another path")
    setup = Setup.from_config(cfg, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
                              precision=args.precision, optimizer=args.optimizer, zero_stage=args.zero_stage,
                              dp=args.dp, tp=args.tp, pp=args.pp, recompute=args.recompute, attention=args.attention,
                              fp32_attention=args.fp32_attention,
                              hardware=args.hardware, mfu=args.mfu, tokens=args.tokens)
    try:
        setup.validate(cfg.model)
        machine = None
        if setup.hardware == "this":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            name, peak, memory = this_device(matmul_dtype(setup.precision), device, remeasure=args.remeasure)
            machine = (f"this machine: {name}", peak, memory)
        plan = make_plan(cfg.model, setup, machine)
    except ValueError as err:
        raise LmforgeError(str(err)) from None
    if args.plot:
        plot_memory(plan, args.plot, name=args.model or DEFAULT_PRESET)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print_plan(console, plan, title=f"lmforge plan: {args.model or DEFAULT_PRESET}")
        if args.plot:
            console.print(f"memory chart: {args.plot}")
    return 0


def cmd_runs(args) -> int:
    from lmforge.runs import find_runs, plot_runs, print_runs

    if args.plot is None:
        print_runs(find_runs(args.dir), args.dir)
        return 0
    plot_runs(args.dir, args.plot, args.out)
    print(f"loss curves: {args.out}")
    return 0


def cmd_tasks(args) -> int:
    import json

    from lmforge.structured.tasks import TRAINING_MIX, training_documents

    if args.n < 1:
        raise LmforgeError("-n must be >= 1")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise LmforgeError(f"--out {out}: folder {out.parent} does not exist; create it or pick another path")
    docs = training_documents(args.n, args.seed)
    staging = out.with_name(out.name + ".tmp")
    staging.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="utf-8")
    staging.replace(out)  # whole or not at all
    mix = ", ".join(f"{share:.0%} {name}" for name, share in TRAINING_MIX.items())
    print(f"{out}: {len(docs):,} documents ({mix}), seed {args.seed}")
    return 0


def cmd_eval_format(args) -> int:
    from lmforge.structured.evaluate import conditions, run_study, study_plan

    words = {name: [word.strip() for word in getattr(args, name).split(",") if word.strip()]
             for name in ("kinds", "modes", "formats")}
    conds = conditions(words["modes"], words["formats"])
    if not conds:
        raise LmforgeError("nothing to evaluate: give at least one mode (and a format for modes other than free)")
    if args.max_new_tokens < 1:
        raise LmforgeError("--max-new-tokens must be >= 1")
    tasks = study_plan(words["kinds"], args.tasks, args.seed)
    if not Path(args.model).is_dir():
        raise LmforgeError(f"run folder {args.model} does not exist")
    out = Path(args.out) if args.out else Path(args.model) / "eval-format"
    run_study(args.model, tasks, conds, out, args.max_new_tokens, args.device, progress=not args.no_progress)
    print(f"results: {out}/table.md, {out}/results.png, {out}/results.jsonl")
    return 0
