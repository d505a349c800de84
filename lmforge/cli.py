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
from lmforge.common.errors import LmforgeError, os_error_message
from lmforge.modes.attention import BACKENDS
from lmforge.modes.precision import ALIASES, POLICIES
from lmforge.modes.recompute import RECOMPUTE_MODES

EXAMPLES = """\
examples:
  lmforge train                                      # default model on the embedded corpus, ~10 min on CPU
  lmforge train --model tiny train.max_steps=50      # presets: {presets}
  lmforge train --config my.yaml model.n_layers=8 train.max_steps=2000
  lmforge train --resume runs/<name>                 # continue where the run stopped
  lmforge generate --run runs/<name> --prompt "def fib(" --max-new-tokens 100
  lmforge plan --model llama3-8b --batch-size 1 --seq-len 8192 --precision bf16-mixed --hardware h100-sxm
  lmforge runs                                       # the runs in runs/ side by side
  lmforge export --format hf runs/<name>             # a Hugging Face folder (transformers loads it)
  lmforge import-hf path/to/hf-model --out runs/x    # a Hugging Face Llama or GPT-2 as a run folder
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
    train.add_argument("--nproc", type=int, metavar="N",
                       help="start N processes on this machine through torchrun's launcher (with train.parallel=ddp, "
                            "zero1, zero2, zero3 or fsdp); the same as torchrun --standalone --nproc_per_node=N "
                            "-m lmforge train ...")

    finetune = commands.add_parser(
        "finetune", help="fine-tune a trained model on your data, fully or with LoRA adapters",
        description="Fine-tune the model of a run folder (--base) on data.source: plain text, or .jsonl examples "
                    "{\"prompt\", \"response\"} / {\"messages\": [...]} with the loss on the responses only. "
                    "With --lora-rank only low-rank adapters train and checkpoints hold only them; without, "
                    "every weight trains. Same trainer, checkpoints, resume, summary and plan as train.",
        epilog="examples:\n"
               "  lmforge finetune --base runs/small data.source=pairs.jsonl --lora-rank 16 --lora-alpha 32\n"
               "  lmforge finetune --base runs/small data.source=pairs.jsonl train.seq_len=128   # full fine-tuning\n"
               "  lmforge finetune --resume runs/<name>\n"
               "  lmforge generate --run runs/<name> --prompt '...'   # base + adapter (--merge: folded in)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    finetune.add_argument("--base", metavar="RUN", help="the model to fine-tune: an lmforge run folder")
    finetune.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank (default: full fine-tuning)")
    finetune.add_argument("--lora-alpha", type=float, help="LoRA scale alpha: the update is alpha/rank * B A "
                                                           "(default 2 * rank)")
    finetune.add_argument("--lora-targets", help="linear layers to adapt, comma-separated name patterns "
                                                 "(default q_proj,k_proj,v_proj,o_proj; e.g. 'attn.*,mlp.*')")
    finetune.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default 0)")
    finetune.add_argument("--config", metavar="FILE", help="YAML file with data/optim/train/finetune sections")
    finetune.add_argument("overrides", nargs="*", metavar="section.key=value",
                          help="config overrides, e.g. data.source=pairs.jsonl train.max_steps=300 optim.lr=1e-3")
    finetune.add_argument("--name", help="run name: the run folder is runs/NAME")
    finetune.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")
    finetune.add_argument("--resume", metavar="RUN", help="continue the fine-tuning run in folder RUN")
    finetune.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")

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
    gen.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the base weights "
                                                          "first (the same outputs, one matmul per layer)")
    gen.add_argument("--format", metavar="FMT", help="constrain the answer to FMT while decoding: json "
                                                    "(prints only the answer; exit 2 if it is cut by --max-new-tokens)")
    gen.add_argument("--schema", metavar="FILE", help="JSON Schema the --format json answer must match")

    plan = commands.add_parser(
        "plan", help="predict FLOPs, memory per device and time for a setup, before running it",
        description="Print what a training setup costs: parameters, FLOPs per token and per step, memory per "
                    "device with its breakdown (and whether it fits), time per step at an assumed MFU, and the "
                    "time, FLOPs and device-hours of a token budget. With --inference, what serving costs: "
                    "weights, KV cache, prefill and decode time, the largest batch that fits. Batch, sequence, "
                    "precision, recompute and attention default to the config's values. Options marked LIST "
                    "take several values separated by commas with --compare.",
        epilog="examples:\n"
               "  lmforge plan                                   # the default model on this machine\n"
               "  lmforge plan --model gpt3-175b --batch-size 128 --seq-len 2048 --precision fp16 --recompute none --json\n"
               "  lmforge plan --model llama3-70b --batch-size 1 --seq-len 8192 --precision bf16-mixed \\\n"
               "      --zero-stage 3 --dp 64 --recompute full --hardware h100-sxm --tokens 15e12 --plot plan.png\n"
               "  lmforge plan --model llama3-8b --seq-len 8192 --precision bf16-mixed --hardware h100-sxm --dp 8 \\\n"
               "      --compare --zero-stage 0,1,2,3 --recompute none,full --plot compare.png\n"
               "  lmforge plan --model llama3-70b --seq-len 8192 --precision bf16-mixed --hardware h100-sxm \\\n"
               "      --zero-stage 3 --recompute full --solve devices\n"
               "  lmforge plan --pp 4 train.micro_batches=8 train.schedule=1f1b   # per-stage memory, the bubble\n"
               "  lmforge plan --inference --model llama3-8b --batch-size 8 --seq-len 8192 --weights int4 \\\n"
               "      --hardware h100-sxm\n"
               "  lmforge plan --dtypes",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(plan)
    # Several values (comma-separated) are accepted with --compare; each is checked in cmd_plan.
    plan.add_argument("--batch-size", metavar="LIST", help="sequences per micro-batch per data-parallel rank "
                                                           "(--inference: sequences decoded together)")
    plan.add_argument("--seq-len", metavar="LIST", help="tokens per sequence (--inference: the context)")
    plan.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    plan.add_argument("--precision", metavar="LIST", help=f"{', '.join(POLICIES)} (or {aliases})")
    plan.add_argument("--optimizer", metavar="LIST", help="adamw (default), adamw-8bit, adafactor, lion, "
                                                          "sgd-momentum or sgd")
    plan.add_argument("--zero-stage", metavar="LIST", help="ZeRO stage 0-3 (shards over --dp; default 0)")
    plan.add_argument("--dp", metavar="LIST", help="data-parallel degree (default 1)")
    plan.add_argument("--tp", metavar="LIST", help="tensor-parallel degree (default 1)")
    plan.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                      help="with --tp: split norms and the layer input along the sequence too (default on; "
                           "Korthikanti et al. 2022 table 2 has both)")
    plan.add_argument("--pp", metavar="LIST", help="pipeline stages: the same as train.pipeline_stages (default 1); "
                                                 "micro-batches and schedule: train.micro_batches, train.schedule")
    plan.add_argument("--recompute", metavar="LIST", help=f"activation recomputation: {', '.join(RECOMPUTE_MODES)}")
    plan.add_argument("--attention", metavar="LIST",
                      help=f"{', '.join(BACKENDS)} (naive keeps the s x s scores, the others do not)")
    plan.add_argument("--fp32-attention", action="store_true", default=None,
                      help="attention core in fp32 under a low-precision policy (train.fp32_attention)")
    plan.add_argument("--hardware", metavar="LIST", default="this",
                      help="this (measure this machine) or one of: a100, h100-sxm, h100-pcie, h200, b200, l4, "
                           "rtx4090, mi300x")
    plan.add_argument("--mfu", type=float, default=0.5,
                      help="MFU assumed for the time estimate, and for prefill with --inference (default 0.5)")
    plan.add_argument("--tokens", type=float, help="token budget for the total time, FLOPs and cost (default: "
                                                   "Chinchilla's 20 tokens per parameter)")
    plan.add_argument("--price-per-hour", type=float, help="price of one device-hour, for the cost of the budget")
    plan.add_argument("--reserve", type=float, default=2.0, metavar="GIB",
                      help="GiB per device kept free for the CUDA context and allocator fragmentation (default 2)")
    plan.add_argument("--inference", action="store_true",
                      help="plan serving instead of training: weights, KV cache, prefill, decode, largest batch")
    plan.add_argument("--weights", metavar="LIST", help="--inference: fp32, bf16 (default), fp16, int8 or int4")
    plan.add_argument("--group-size", type=int, help="--inference: weights per int8/int4 scale (default 128)")
    plan.add_argument("--kv-dtype", metavar="LIST", help="--inference: KV cache in fp32, bf16 (default), fp16, "
                                                         "fp8 or int8")
    plan.add_argument("--compare", action="store_true",
                      help="plan every combination of the LIST options given, as one table (and one --plot)")
    plan.add_argument("--solve", choices=("batch", "devices"),
                      help="find the largest micro-batch that fits, or the fewest devices (dp x tp x pp; "
                           "--inference: tp) that fit")
    plan.add_argument("--lora-rank", type=int, help="LoRA fine-tuning at this rank: count the trainable adapters "
                                                    "and the gradient and optimizer bytes saved")
    plan.add_argument("--lora-targets", help="linear layers LoRA wraps, comma-separated name patterns "
                                             "(default q_proj,k_proj,v_proj,o_proj)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--plot", metavar="PNG", help="save a bar chart of the memory breakdown")
    plan.add_argument("--dtypes", action="store_true", help="print the table of floating-point formats and exit")
    plan.add_argument("--remeasure", action="store_true",
                      help="with --hardware this: measure the matmul peak and memory bandwidth again")

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
    export = commands.add_parser(
        "export", help="write a run's model in another format: a Hugging Face folder",
        description="Write the newest checkpoint of RUN (or the checkpoint folder RUN) as a Hugging Face folder: "
                    "config.json, model.safetensors and tokenizer files that transformers' AutoModelForCausalLM "
                    "and AutoTokenizer load (llama family: LlamaForCausalLM; gpt: GPT2LMHeadModel).")
    export.add_argument("run", metavar="RUN", help="run folder or checkpoint folder")
    export.add_argument("--format", required=True, choices=["hf", "peft"],
                        help="hf: Hugging Face transformers (a LoRA run: adapters merged into the base); "
                             "peft: a LoRA run's adapter alone, in PEFT's layout")
    export.add_argument("--out", metavar="DIR", help="folder to write (default: RUN/hf-step_NNNNNNN)")

    import_hf = commands.add_parser(
        "import-hf", help="read a Hugging Face Llama or GPT-2 folder into a run folder",
        description="Read a local Hugging Face model folder (config.json, model.safetensors, tokenizer.json) of a "
                    "LlamaForCausalLM (Llama 3.1/3.2 rope scaling included) or GPT2LMHeadModel and write it as a "
                    "run folder, with its own tokenizer, that lmforge generate and export take.")
    import_hf.add_argument("folder", metavar="FOLDER", help="the Hugging Face model folder")
    import_hf.add_argument("--name", help="run name: the run folder is runs/NAME (default: FOLDER's name)")
    import_hf.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")

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
    evalf.add_argument("model", metavar="RUN", help="an lmforge run folder, or a local Hugging Face Llama or GPT-2 folder")
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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `train --nproc` hands to torchrun
    if args.command is None:
        parser.print_help()
        return 0
    try:
        commands = {"prepare": cmd_prepare, "train": cmd_train, "finetune": cmd_finetune, "generate": cmd_generate,
                    "plan": cmd_plan, "runs": cmd_runs, "export": cmd_export, "import-hf": cmd_import_hf,
                    "tasks": cmd_tasks, "eval-format": cmd_eval_format}
        status = commands[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled below
        return status
    except LmforgeError as err:
        if not _quiet_rank(err):
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


def _quiet_rank(err: LmforgeError) -> bool:
    """Under torchrun every rank stops on a bad setting, but one line is enough: the first process
    of each node prints it, and an error rank 0 reports for the whole run only rank 0 prints."""
    return getattr(err, "reported_on_rank0", False) or os.environ.get("LOCAL_RANK", "0") != "0"


def launch(nproc: int, argv: list[str]) -> int:
    """`lmforge train --nproc N ...`: torchrun's own launcher (standalone: a rendezvous on a free
    local port) starting N processes of `lmforge train ...`; exit status of the first that failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    options = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", "--module", "lmforge", *argv])
    try:
        run(options)
    except ChildFailedError as err:
        code = err.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else code  # killed by signal S: 128 + S, as a shell says
    except SignalException as err:  # the launcher itself got SIGTERM/SIGINT; the ranks stopped on it too
        return 128 + err.sigval
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif not word.startswith("--nproc="):
            out.append(word)
    return out


def cmd_prepare(args) -> int:
    from lmforge.data.prepare import prepare_data

    cfg = make_config(args.model or DEFAULT_PRESET, args.config, args.overrides)
    data = prepare_data(cfg)
    meta = data.meta
    print(f"{data.dir}: tokenizer.json ({meta['tokenizer_vocab_size']} tokens), "
          f"train.bin ({meta['splits']['train']['tokens']:,} tokens), val.bin ({meta['splits']['val']['tokens']:,} tokens)")
    return 0


def _resumed_config(args):
    """The config of the run named by --resume, with train.* and optim.* overrides applied."""
    if args.config or getattr(args, "model", None) or getattr(args, "base", None) or args.name or args.out:
        raise LmforgeError("--resume takes its config from the run; only train.* and optim.* overrides may be added")
    run_dir = Path(args.resume)
    if not (run_dir / "config.yaml").is_file():
        raise LmforgeError(f"{run_dir} is not a run folder (no config.yaml)")
    from lmforge.runs.folders import check_not_imported

    check_not_imported(run_dir)  # a model imported from Hugging Face is not a run to resume
    cfg = load_config(run_dir / "config.yaml")
    for item in args.overrides:
        key, value = parse_override(item)
        if not key.startswith(("train.", "optim.")):
            raise LmforgeError(f"cannot change {key} when resuming: only train.* and optim.* settings may change")
        set_value(cfg, key, value, origin="command line")
    validate(cfg)
    return cfg, run_dir


def cmd_train(args) -> int:
    if args.resume:
        cfg, run_dir = _resumed_config(args)
    else:
        preset = args.model or DEFAULT_PRESET
        cfg = make_config(preset, args.config, args.overrides)
        if args.out:
            run_dir = Path(args.out)
        else:
            run_dir = Path("runs") / (args.name or f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.nproc is not None:
        if args.nproc < 1:
            raise LmforgeError(f"--nproc {args.nproc}: start at least 1 process")
        if cfg.train.parallel == "none" and cfg.train.pipeline_stages == 1:
            raise LmforgeError(f"--nproc {args.nproc} needs a way to share the work: add train.parallel=ddp "
                               f"(or zero1, zero2, zero3, fsdp)")
        if "WORLD_SIZE" in os.environ:
            raise LmforgeError("--nproc under torchrun: torchrun already started the processes; drop --nproc")
        words = _without_nproc(args.argv)
        if not args.resume and not (args.name or args.out):  # one folder for all ranks, named here
            words += ["--out", str(run_dir)]
        return launch(args.nproc, words)
    return _run_trainer(cfg, run_dir, args, "train")


# Fine-tuning starts from a trained model: fewer steps, a short warmup and a lower peak rate than
# training from scratch (each can be overridden).
FINETUNE_DEFAULTS = ("train.max_steps=200", "optim.warmup_steps=20", "optim.lr=1e-3", "train.eval_interval=50",
                     "train.checkpoint_interval=100")


def cmd_finetune(args) -> int:
    if args.resume:
        flags = [args.lora_rank, args.lora_alpha, args.lora_targets, args.lora_dropout]
        if any(flag is not None for flag in flags):
            raise LmforgeError("--resume takes its LoRA settings from the run; only train.* and optim.* overrides "
                               "may be added")
        cfg, run_dir = _resumed_config(args)
        if cfg.finetune.base is None:
            raise LmforgeError(f"{run_dir} is not a fine-tuning run: continue it with lmforge train --resume {run_dir}")
        return _run_trainer(cfg, run_dir, args, "finetune")
    if args.base is None:
        raise LmforgeError("lmforge finetune needs --base RUN (the run folder of the model to fine-tune)")
    for item in args.overrides:
        key, _ = parse_override(item)
        if key.startswith(("model.", "finetune.base")):
            raise LmforgeError(f"cannot set {key}: a fine-tuning run keeps its base's model (use --base)")
    from lmforge.runs.load import base_settings

    base = Path(args.base).resolve()
    base_model, end_token = base_settings(base)  # an lmforge run folder or a Hugging Face folder
    lora = {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "lora_targets": args.lora_targets,
            "lora_dropout": args.lora_dropout}
    flags = [f"finetune.{key}={value}" for key, value in lora.items() if value is not None]
    cfg = make_config(None, args.config, [*FINETUNE_DEFAULTS, f"finetune.base={base}", *flags, *args.overrides])
    cfg.data.end_token = end_token  # the base's own end-of-document token
    cfg.model = base_model
    validate(cfg)
    if args.out:
        run_dir = Path(args.out)
    else:
        kind = f"lora{cfg.finetune.lora_rank}" if cfg.finetune.lora_rank else "full"
        run_dir = Path("runs") / (args.name or f"{base.name}-{kind}-{time.strftime('%Y%m%d-%H%M%S')}")
    return _run_trainer(cfg, run_dir, args, "finetune")


def _run_trainer(cfg, run_dir: Path, args, command: str) -> int:
    from lmforge.accounting.hardware import this_device
    from lmforge.runs.checkpoint import list_checkpoints
    from lmforge.train.host_memory import retain_freed_memory
    from lmforge.train.loop import Trainer
    from lmforge.parallel.world import resolve_device
    from lmforge.train.signals import Stopped

    if resolve_device(cfg.train.device).type == "cpu":
        retain_freed_memory()  # process-wide malloc tuning, chosen here (train/host_memory.py says why)
    # the measured matmul peak behind MFU, cached per machine (lmforge plan --hardware this --remeasure)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress, machine=this_device)
    resume = f"lmforge {command} --resume {run_dir}"
    try:
        trainer.run()
    except Stopped as stop:  # SIGTERM or a first Ctrl-C: the step finished and was saved (by all ranks)
        if trainer.world.is_main:
            print(f"\nlmforge: {stop}; saved {stop.checkpoint}; continue with: {resume}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # a second Ctrl-C: no save
        if trainer.world.is_main:
            print(f"\nlmforge: interrupted at step {trainer.step}; continue from the last checkpoint with: "
                  f"{resume}", file=sys.stderr)
        return 130
    except OSError as err:
        if not list_checkpoints(run_dir):
            raise
        raise LmforgeError(f"{os_error_message(err)}; then continue from the last checkpoint with: {resume}") from None
    return 0


def cmd_generate(args) -> int:
    from lmforge.generate.sampling import generate
    from lmforge.runs import checkpoint as ckpt
    from lmforge.runs.load import model_from_checkpoint
    from lmforge.parallel.world import resolve_device

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
    cfg, model, tokenizer = model_from_checkpoint(path, merge=args.merge)  # a LoRA run: its base + adapters
    model.to(device)
    end = tokenizer.token_to_id(cfg.data.end_token)
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

    from rich.console import Console

    from lmforge.accounting.plan.chart import plot_comparison, plot_memory
    from lmforge.accounting.plan.compare import print_comparison_table
    from lmforge.accounting.plan.show import print_dtypes, print_plan
    from lmforge.accounting.plan.setups import plan_overrides, plan_setups

    console = Console()
    if args.dtypes:
        print_dtypes(console)
        return 0
    name = args.model or DEFAULT_PRESET
    cfg = make_config(name, args.config, plan_overrides(args))
    if args.plot and not Path(args.plot).parent.is_dir():
        raise LmforgeError(f"--plot {args.plot}: folder {Path(args.plot).parent} does not exist; create it "
                           f"or pick another path")
    plans, varying, note = plan_setups(cfg, args)  # LmforgeError for bad input, before anything is written
    if args.compare:
        if args.plot:
            plot_comparison(plans, varying, args.plot, name=name)
        if args.json:
            print(json.dumps(plans, indent=2))
        else:
            print_comparison_table(console, plans, varying, title=f"lmforge plan --compare: {name}")
            if args.plot:
                console.print(f"comparison chart: {args.plot}")
        return 0
    plan, = plans
    if args.plot:
        plot_memory(plan, args.plot, name=name)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print_plan(console, plan, title=f"lmforge plan{' --inference' if args.inference else ''}: {name}")
        if note:
            console.print(note)
        if args.plot:
            console.print(f"memory chart: {args.plot}")
    return 0


def cmd_runs(args) -> int:
    from lmforge.runs.listing import find_runs, plot_runs, print_runs

    if args.plot is None:
        print_runs(find_runs(args.dir), args.dir)
        return 0
    plot_runs(args.dir, args.plot, args.out)
    print(f"loss curves: {args.out}")
    return 0


def cmd_export(args) -> int:
    from lmforge.runs.folders import export_run

    out = export_run(args.run, args.out, args.format)
    if args.format == "peft":
        print(f"{out}: a PEFT LoRA adapter; load it with peft.PeftModel.from_pretrained(<the base, exported with "
              f"--format hf from the base run>, {str(out)!r})")
    else:
        print(f"{out}: a Hugging Face folder; load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_import_hf(args) -> int:
    from lmforge.runs.folders import import_run

    if args.name and args.out:
        raise LmforgeError("give --name or --out, not both")
    out = Path(args.out) if args.out else Path("runs") / (args.name or Path(args.folder).resolve().name)
    import_run(args.folder, out)
    print(f"{out}: imported; try lmforge generate --run {out} --prompt \"...\"")
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
