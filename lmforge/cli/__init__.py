"""The `lmforge` command: parser.py reads the command line, commands.py runs each subcommand,
launch.py starts `train --nproc N`, run_config.py assembles a training's config."""

from lmforge.cli.commands import main
from lmforge.cli.parser import build_parser, parse_args

__all__ = ["build_parser", "main", "parse_args"]
