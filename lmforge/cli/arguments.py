"""Reading the `lmforge` command line: the arguments several subcommands share (the config and its
overrides, the run folder RUN, a training's outputs), the options of the training subcommands (prepare,
train, finetune), and `parse_args`. The parser reports a mistake in one line; `number`, the type of
every numeric option, checks it (finite, in range) as it is read.

Every subcommand that takes a config accepts `--config FILE.yaml`, `--model PRESET` and
`section.key=value` overrides, in any order. Every subcommand that reads a run takes it as its
first positional argument, RUN (the older flags, `--run` and `finetune --base`, still work).
Building the parser imports no torch, so that `lmforge --help` answers at once.
"""

import argparse
import math
from pathlib import Path

from lmforge.config import DEFAULT_PRESET, MODEL_PRESETS, _did_you_mean

RAW = argparse.RawDescriptionHelpFormatter
INT64_MAX = 2**63 - 1  # torch's and numpy's integers: a larger count or seed overflows in them


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


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is one line, `lmforge CMD: error: ...`, exit status 2 (argparse
    prints its usage first; `lmforge CMD --help` shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(kind: type, at_least=None, above=None, at_most=None):
    """The argparse type of a numeric option: `kind` (int or float) read from the word, finite, and
    within the bounds given (an int also within int64). Every numeric option of the CLI has one, so a
    bad number stops in one line before any work (tests/test_bad_input.py checks that all do)."""
    if kind is int and at_most is None:
        at_most = INT64_MAX

    def convert(word: str):
        try:
            value = kind(word)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{word!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {word}")
        for ok, bound in ((at_least is None or value >= at_least, f">= {at_least}"),
                          (above is None or value > above, f"> {above}"),
                          (at_most is None or value <= at_most, f"<= {at_most}")):
            if not ok:
                raise argparse.ArgumentTypeError(f"must be {bound}, got {word}")
        return value

    convert.bounds = (kind, at_least, above, at_most)  # read by the tests and docs/bad-input.md's table
    return convert


SEED = number(int, at_least=0)
COUNT = number(int, at_least=1)
PICTURE_SUFFIXES = (".png", ".svg", ".pdf")  # what a picture option writes; matplotlib reads the format from it


def run_name(word: str) -> str:
    """The argparse type of --name: one folder's name under runs/ (a path goes to --out)."""
    if word in ("", ".", "..") or "/" in word or "\\" in word:
        raise argparse.ArgumentTypeError(f"{word!r} is not a run name (runs/NAME): give a path with --out instead")
    return word


def picture(word: str) -> str:
    """The argparse type of an option naming a picture to write (--plot, --roofline, runs --out):
    checked before any work, where matplotlib would refuse only at the end, with a traceback."""
    if Path(word).suffix.lower() not in PICTURE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{word} is not a picture file: end it with {', '.join(PICTURE_SUFFIXES)}")
    if Path(word).is_dir():
        raise argparse.ArgumentTypeError(f"{word} is a folder: name the picture file to write")
    return word


def describe(parser: argparse.ArgumentParser, description: str, epilog: str | None = None) -> None:
    """A subcommand's --help text: its description and examples, laid out as written."""
    parser.description, parser.epilog, parser.formatter_class = description, epilog, RAW


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML file with model/data/optim/train sections")
    parser.add_argument("--model", metavar="PRESET", default=None,
                        help=f"model preset (default {DEFAULT_PRESET}): {', '.join(MODEL_PRESETS)}")
    add_overrides(parser, "model.n_layers=8 train.max_steps=2000 optim.lr=1e-3")


def add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help=f"config overrides, e.g. {example}")


def add_run(parser: argparse.ArgumentParser, help: str, dest: str = "run", flag: str = "--run",
            required: bool = True) -> None:
    """RUN, the first positional argument, and `flag`, its older spelling; `parse_args` makes them one
    (argparse alone cannot: a positional it finds no word for would overwrite the flag's value)."""
    parser.add_argument(dest, nargs="?", metavar="RUN", help=help)
    parser.add_argument(flag, dest=f"{dest}_flag", metavar="RUN", help="the same as RUN")
    parser.run_arg = (dest, flag, required)


def add_training_outputs(parser: argparse.ArgumentParser, resume_help: str) -> None:
    """The run folder a training writes, --resume, and --no-progress (train and finetune)."""
    parser.add_argument("--name", type=run_name,
                        help="run name: the run folder is runs/NAME (default: the model and the time)")
    parser.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")
    parser.add_argument("--resume", metavar="RUN", help=resume_help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")


def one_run(subcommand: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set the command's RUN from the positional word or the older flag, whichever was given.

    Where overrides are positional too (finetune), argparse may have put an override in RUN's place
    or RUN among the overrides: RUN is the first word without '=', the words with one are overrides."""
    dest, flag, required = subcommand.run_arg
    positional, given = getattr(args, dest), getattr(args, f"{dest}_flag")
    delattr(args, f"{dest}_flag")
    if hasattr(args, "overrides"):
        words = [*([positional] if positional is not None else []), *args.overrides]
        first_bare = next((index for index, word in enumerate(words) if "=" not in word), None)
        positional = None if first_bare is None else words.pop(first_bare)
        args.overrides = words
    if positional is not None and given is not None and positional != given:
        if "=" in positional:  # `generate --run r a.b=1`: a stray override, not a second run
            subcommand.error(f"unrecognized arguments: {positional}")
        subcommand.exit(2, f"{subcommand.prog}: error: RUN given twice, as {positional} and as {flag} {given}: "
                           f"give it once\n")
    setattr(args, dest, positional if positional is not None else given)
    if required and getattr(args, dest) is None:
        subcommand.error("the following arguments are required: RUN")


def one_folder(subcommand: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--name NAME and --out DIR both name the run folder (runs/NAME or DIR): given both, they must
    name the same one, or the command stops in one line (train, finetune, import-hf)."""
    name, out = getattr(args, "name", None), getattr(args, "out", None)
    if name is not None and out is not None and Path(out) != Path("runs") / name:
        subcommand.exit(2, f"{subcommand.prog}: error: --name {name} (runs/{name}) and --out {out} name "
                           f"different run folders: give one of them\n")


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
