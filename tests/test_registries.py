"""One registry per concept: every list of names lives once, and what it says agrees with the code
that implements it (issue 10, part 4)."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.accounting.activations import FAMILY_ACTIVATIONS
from lmforge.cli import main
from lmforge.config import FAMILIES
from lmforge.common.errors import LmforgeError
from lmforge.model import transformer
from lmforge.modes import (DATA_PARALLEL, PARALLEL_STRATEGIES, PARAMETER_SHARDING, PIPELINE_SCHEDULES, POLICIES,
                           PRECISION_ALIASES, REPLICATING, SHARDING, STAGE_REPLICAS, get_policy)


def test_config_imports_no_torch():
    """Parsing a config must not load torch (seconds on a busy machine): the name lists it checks
    against come from light modules, and lmforge.precision loads its torch parts only on use."""
    code = ("import sys, lmforge.config; lmforge.config.make_config('tiny', overrides=['train.precision=fp8']); "
            "print('torch loaded:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch loaded: False"


@pytest.mark.parametrize("name", POLICIES)
def test_each_policy_says_its_dtypes_and_bytes_consistently(name):
    """The bytes a policy declares are those of the dtypes it names (torch's own itemsize)."""
    policy = POLICIES[name]
    param = getattr(torch, policy.param_dtype)
    compute = getattr(torch, policy.compute_dtype) if policy.autocast else param
    assert policy.bytes.parameter == policy.bytes.gradient == param.itemsize
    assert policy.bytes.compute == compute.itemsize
    assert policy.bytes.residual == (4 if policy.autocast else param.itemsize)
    assert policy.matmul_dtype == ("float8" if policy.fp8 else str(compute).removeprefix("torch."))


def test_aliases_resolve_and_unknown_names_are_one_line(capsys):
    for alias, full in PRECISION_ALIASES.items():
        assert get_policy(alias) is POLICIES[full]
    with pytest.raises(LmforgeError) as caught:
        get_policy("fp4")
    assert isinstance(caught.value, ValueError)  # also what a library caller expects of a bad argument
    # --recompute is train.recompute: refused by config validation, in the line `lmforge train` gives
    assert main(["plan", "--model", "tiny", "--recompute", "sometimes", "--hardware", "a100"]) == 2
    assert capsys.readouterr().err.strip() == ("lmforge: error: train.recompute must be one of none, selective, full, "
                                               "got 'sometimes'")


def test_every_family_is_built_and_accounted():
    assert tuple(transformer.FAMILIES) == FAMILIES == tuple(FAMILY_ACTIVATIONS)


# -- every strategy, precision and schedule list is modes/'s own (issue 42, part 6) ---------------

NAME_SETS = {  # the names of each concept, and the objects modes/ defines for it
    "strategy": (set(PARALLEL_STRATEGIES), (PARALLEL_STRATEGIES, SHARDING, REPLICATING, DATA_PARALLEL, STAGE_REPLICAS, PARAMETER_SHARDING)),
    "precision": (set(POLICIES), (POLICIES,)),
    "schedule": (set(PIPELINE_SCHEDULES), (PIPELINE_SCHEDULES,)),
}
# files whose name lists other helpers of issue 42 rewrite (the plan's Setup, the engines): their
# literals go with that work; delete each entry as it lands
PENDING = {"lmforge/parallel/parallelize.py"}


def family_of(names) -> str | None:
    names = set(names)
    if len(names) >= 2 and all(isinstance(n, str) for n in names):
        return next((f for f, (known, _) in NAME_SETS.items() if names <= known), None)
    return None


def keyed_by_a_modes_set(keys, family: str) -> bool:
    """A table keyed by names (name -> engine, name -> why) covers one of modes/'s sets, or the rest of one."""
    known, objects = NAME_SETS[family]
    return any(set(keys) in (set(o), known - set(o)) for o in objects)


def lmforge_modules():
    for info in pkgutil.walk_packages(lmforge.__path__, "lmforge."):
        if not info.name.endswith("__main__") and not info.name.startswith("lmforge.modes"):
            yield importlib.import_module(info.name)


def test_every_list_of_names_outside_modes_is_modes_own_object():
    """A module-level list of strategies, precisions or schedules is the object modes/ defines (by
    identity: a copy, even one computed from modes/, fails); a table keyed by them covers one of
    modes/'s sets."""
    for module in lmforge_modules():
        for name, value in vars(module).items():
            where = f"{module.__name__}.{name}"
            if isinstance(value, dict):
                family = family_of(value)
                assert family is None or keyed_by_a_modes_set(value, family), where
            elif isinstance(value, (tuple, list, set, frozenset)) and family_of(value):
                assert any(value is o for o in NAME_SETS[family_of(value)][1]), f"{where} copies modes/'s names"


def test_no_literal_list_of_names_outside_modes():
    """The same for lists written inline (`parallel in ("zero1", "zero2")`): none outside modes/."""
    root = Path(lmforge.__file__).parent.parent
    found = []
    for path in sorted((root / "lmforge").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("lmforge/modes/") or relative in PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)) or not items:
                continue
            words = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
            family = family_of(words) if len(words) == len(items) else None
            if family and not (isinstance(node, ast.Dict) and keyed_by_a_modes_set(words, family)):
                found.append(f"{relative}:{node.lineno} {sorted(words)}")
    assert not found, found


def test_plan_hardware_help_names_every_accelerator_of_the_table():
    """`lmforge plan --hardware`'s help lists the datasheet table's names (accounting/hardware.py's
    ACCELERATORS; the parser imports no torch, so it spells them out): the two must say the same."""
    from lmforge.accounting.hardware import ACCELERATORS
    from lmforge.cli import build_parser

    plan = build_parser(["plan"]).subcommands["plan"]
    help_text = next(action.help for action in plan._actions if "--hardware" in action.option_strings)
    assert help_text.endswith("one of: " + ", ".join(ACCELERATORS))
