"""Arguments several subcommands share: the config and its overrides, the run folder (RUN), a
training's outputs; the parser class, which reports a mistake in one line; and `number`, the type
of every numeric option, which checks it (finite, in range) as it is read."""

import argparse
import math
from pathlib import Path

from lmforge.config import DEFAULT_PRESET, MODEL_PRESETS

RAW = argparse.RawDescriptionHelpFormatter
INT64_MAX = 2**63 - 1  # torch's and numpy's integers: a larger count or seed overflows in them


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
    parser.add_argument("--name", help="run name: the run folder is runs/NAME (default: the model and the time)")
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
