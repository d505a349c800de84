"""The `lmforge` command. parser.py builds the parser (one function per subcommand; plan's options
in plan_parser.py, the shared ones in arguments.py) and reads the command line; commands.py runs
each subcommand; run_config.py assembles a training's config; launch.py starts `train --nproc N`."""

from lmforge.cli.commands import main
from lmforge.cli.parser import build_parser, parse_args

__all__ = ["build_parser", "main", "parse_args"]
