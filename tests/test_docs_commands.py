"""Every `lmforge ...` command that README.md and docs/*.md show parses, and builds a valid config.

A command is a line in a ``` code block (not a python, yaml or json one) that starts with `lmforge`
(after an optional `$ ` prompt and `VAR=value` words), or a `torchrun ... -m lmforge ...` (or
`python -m lmforge ...`) line, of which the words after `-m lmforge` count; in a table row, a code
span that starts with `lmforge `. `\\` continues a line, `# ...` ends it. A placeholder in angle
brackets (`runs/<name>`) stands for one word. Nothing runs: the words go through the command's own
parser, and those of train, prepare, plan and finetune (without --resume) through the config they
build, as lmforge/cli's command functions build it; a `--config FILE` that is not in the
repository is the reader's own and is left out. No torch is loaded.

A command shown with its error (`$ lmforge ...` followed by a line `lmforge: error: MESSAGE`) must
fail with that message.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from lmforge.cli import build_parser, parse_args
from lmforge.common.errors import LmforgeError
from lmforge.config import DEFAULT_PRESET, make_config, parse_override, resume_may_change
from lmforge.config.validate import config_warnings
from lmforge.modes import BACKENDS, POLICIES, PRECISION_ALIASES, RECOMPUTE_MODES

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_SHELL = {"python", "py", "yaml", "yml", "json"}
COMMAND = re.compile(r"^(\$ )?(\w+=\S*\s+)*(lmforge(\s|$)|(torchrun|\S*python3?)\s.*-m lmforge(\s|$))")
TABLE_COMMAND = re.compile(r"`(lmforge [^`]*)`")
PLACEHOLDER = re.compile(r"<([^<>]+)>")


def command_lines(text: str) -> list[tuple[int, list[str], str | None]]:
    """(line number, the words after `lmforge`, the error shown after it or None) of every command
    in the text's code blocks."""
    commands, language, logical, start, ended = [], None, "", 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            language = None if language is not None else line.strip()[3:].strip().lower()
            continue
        if language is None and line.startswith("|"):  # a table row: its `lmforge ...` code spans
            commands += [(number, command_words(span), None) for span in TABLE_COMMAND.findall(line)]
            continue
        if language is None or language in NOT_SHELL:
            continue
        shown = line.strip().removeprefix("lmforge: error: ")
        if shown != line.strip() and ended == number - 1:  # the error the command above gives
            commands[-1] = (*commands[-1][:2], shown)
            continue
        if not logical:
            start = number
        logical += line.strip()
        if logical.endswith("\\"):  # a continued line: the next one joins it
            logical = logical[:-1] + " "
            continue
        if COMMAND.match(logical):
            commands.append((start, command_words(logical), None))
            ended = number
        logical = ""
    return commands


def command_words(line: str) -> list[str]:
    words = shlex.split(PLACEHOLDER.sub(lambda m: re.sub(r"\W+", "-", m.group(1)), line.removeprefix("$ ")),
                        comments=True)
    for at in range(len(words) - 1):
        if words[at:at + 2] == ["-m", "lmforge"]:  # torchrun ... -m lmforge, python -m lmforge
            return words[at + 2:]
    return words[words.index("lmforge") + 1:]  # after any VAR=value words


def config_file(args) -> str | None:
    path = getattr(args, "config", None)
    return str(ROOT / path) if path and (ROOT / path).is_file() else None


def check_resumed(args) -> None:
    """cli's resumed_config: the run's own config, only what config.resume_may_change allows may change."""
    assert not (args.config or getattr(args, "model", None) or args.name or args.out), \
        "--resume takes its config from the run"
    for item in args.overrides:
        key, _ = parse_override(item)
        assert resume_may_change(key), f"cannot change {key} when resuming"
    make_config(DEFAULT_PRESET, None, args.overrides)  # the keys exist and their values are valid


def check_train(args) -> None:
    if getattr(args, "resume", None):
        return check_resumed(args)
    cfg = make_config(args.model or DEFAULT_PRESET, config_file(args), args.overrides)
    assert not config_warnings(cfg), config_warnings(cfg)[0]  # e.g. a run all warmup, whose schedule never shows
    if getattr(args, "nproc", None) is not None:
        assert cfg.train.parallel != "none" or cfg.parallel.pp > 1 or cfg.parallel.tp > 1, \
            "--nproc needs train.parallel (or parallel.pp, parallel.tp) to share the work"


def check_finetune(args) -> None:
    lora = {key: getattr(args, key) for key in ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")}
    if args.resume:
        assert all(value is None for value in lora.values()), "--resume takes its LoRA settings from the run"
        return check_resumed(args)
    base = getattr(args, "base", None) or getattr(args, "run", None)
    assert base, "lmforge finetune needs the run folder of the model to fine-tune"
    for item in args.overrides:
        key, _ = parse_override(item)
        assert not key.startswith(("model.", "finetune.base")), f"{key}: a fine-tuning run keeps its base's model"
    flags = [f"finetune.{key}={value}" for key, value in lora.items() if value is not None]
    make_config(None, config_file(args), [f"finetune.base={base}", *flags, *args.overrides])


def check_plan(args) -> None:
    overrides = list(args.overrides)
    if args.pp is not None:  # lmforge/cli/plan_options.py: --pp is an alias of parallel.pp
        overrides.append(f"parallel.pp={max(int(value) for value in args.pp.split(','))}")
    make_config(args.model or DEFAULT_PRESET, config_file(args), overrides)
    for option, names in (("precision", [*POLICIES, *PRECISION_ALIASES]), ("recompute", RECOMPUTE_MODES),
                          ("attention", BACKENDS)):
        for value in (getattr(args, option) or "").split(","):
            assert not value or value.strip() in names, f"--{option} {value}: not one of {', '.join(names)}"


CONFIG_CHECKS = {"train": check_train, "prepare": check_train, "finetune": check_finetune, "plan": check_plan}


def check(words: list[str]) -> None:
    """Parse the words as `lmforge` would, then build the command's config: AssertionError or
    LmforgeError for a command that would stop before it starts its work."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(build_parser(), words)
    except SystemExit as stop:  # argparse: --help exits 0, a bad option 2 (its message on stderr)
        message = errors.getvalue().strip().splitlines()
        assert stop.code == 0 and ("--help" in words or "-h" in words), message[-1] if message else stop.code
        return
    if args.command in CONFIG_CHECKS:
        CONFIG_CHECKS[args.command](args)


COMMANDS = [pytest.param(words, error, id=f"{page.name}:{number}")
            for page in PAGES for number, words, error in command_lines(page.read_text())]


@pytest.mark.parametrize("words, error", COMMANDS)
def test_documented_command_parses_and_configures(words, error):
    if error is None:
        check(words)
    else:
        with pytest.raises(LmforgeError) as raised:
            check(words)
        assert str(raised.value) == error


def test_the_pages_show_commands():
    pages = {param.id.split(":")[0] for param in COMMANDS}
    assert "README.md" in pages and len(COMMANDS) >= 40, pages


def test_extraction():
    text = "\n".join([
        "```bash",
        "lmforge train --model tiny train.max_steps=200   # a comment",
        "$ lmforge generate runs/<my run> --prompt 'a # b'",
        "torchrun --nnodes=2 --rdzv_endpoint=node0:29500 \\",
        "    --rdzv_id=run42 -m lmforge train train.parallel=fsdp",
        "WANDB_MODE=offline lmforge train train.wandb=true",
        "lmforge: error: command line: a shown error",
        "lmforge: error: not a command",
        "make test",
        "$ .venv/bin/python -m lmforge runs",
        "```",
        "lmforge train outside a block",
        "| train | `lmforge train --model tiny` | `lmforge.config` |",
        "```python",
        "lmforge = 1",
        "```",
    ])
    assert command_lines(text) == [
        (2, ["train", "--model", "tiny", "train.max_steps=200"], None),
        (3, ["generate", "runs/my-run", "--prompt", "a # b"], None),
        (4, ["train", "train.parallel=fsdp"], None),
        (6, ["train", "train.wandb=true"], "command line: a shown error"),
        (10, ["runs"], None),
        (13, ["train", "--model", "tiny"], None),
    ]


@pytest.mark.parametrize("words", [
    ["train", "--modle", "tiny"],                       # a misspelt option
    ["train", "model.n_layer=8"],                       # a misspelt config key
    ["train", "train.precision=bf17-mixed"],            # a value the setting does not take
    ["train", "--resume", "runs/x", "model.n_layers=8"],  # a setting a resumed run cannot change
    ["train", "--nproc", "2", "--model", "tiny"],       # processes with no way to share the work
    ["plan", "--recompute", "partial"],
])
def test_a_wrong_command_fails(words):
    with pytest.raises((AssertionError, LmforgeError)):
        check(words)


def test_readme_commands_read_only_files_the_clone_ships():
    """A README row runs as written on a fresh clone: every file or folder its data.source names
    (examples/...) is in the repository; a placeholder (runs/<name>) is the reader's own."""
    named = [part for _, words, _ in command_lines((ROOT / "README.md").read_text()) for word in words
             if word.startswith("data.source=") for part in word.removeprefix("data.source=").split(",")]
    assert named and all((ROOT / part).exists() for part in named), [p for p in named if not (ROOT / p).exists()]
