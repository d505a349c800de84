"""The `lmforge` command. commands.py holds every subcommand's table entry, builds the parser and runs
each subcommand (`main`); arguments.py reads the command line (the shared arguments, training's
options, `parse_args`); options.py, plan_parser.py and scaling.py add the other subcommands'
options; training.py runs train and finetune in this process, launch.py starts `train --nproc N`."""

from lmforge.cli.arguments import parse_args
from lmforge.cli.commands import build_parser, main

__all__ = ["build_parser", "main", "parse_args"]
