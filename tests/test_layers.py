"""The layering is a contract: import-linter's layers contract in pyproject.toml, checked here.

Each package imports only from those below it (lmforge.common at the bottom, lmforge.cli at the
top), and the contract lists no exceptions: an upward import fails this test."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layers_contract_holds_with_no_exceptions():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = settings["contracts"]
    assert contract["type"] == "layers" and not contract.get("ignore_imports")
    packages = {p.name for p in (ROOT / "lmforge").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "lmforge").glob("*.py")} - {"__init__", "__main__"}
    assert {layer.split(".")[1] for layer in contract["layers"]} == packages | modules, "every package has its layer"
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout
