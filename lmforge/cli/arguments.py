"""Arguments several subcommands share: the config and its overrides, the run folder (RUN), a
training's outputs."""

import argparse

from lmforge.config import DEFAULT_PRESET, MODEL_PRESETS

RAW = argparse.RawDescriptionHelpFormatter


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
