"""One registry per concept: every list of names lives once, and what it says agrees with the code
that implements it (issue 10, part 4)."""

import subprocess
import sys

import pytest
import torch

from lmforge.accounting.activations import FAMILY_ACTIVATIONS
from lmforge.cli import main
from lmforge.config import FAMILIES
from lmforge.common.errors import LmforgeError
from lmforge.model import transformer
from lmforge.modes.precision import ALIASES, POLICIES, get_policy


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
    for alias, full in ALIASES.items():
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
