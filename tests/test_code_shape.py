"""The shape issue 42 holds lmforge/ to: no file over 300 lines, no line over 120 characters, no
function over 60 lines (a longer one usually holds two ideas; README's layout says where each lives)."""

import ast
from pathlib import Path

import lmforge

PACKAGE = Path(lmforge.__file__).parent
MAX_FILE_LINES, MAX_LINE_CHARS, MAX_FUNCTION_LINES = 300, 120, 60


def test_files_lines_and_functions_stay_short():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name, text = path.relative_to(PACKAGE.parent), path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_FILE_LINES:
            too_long.append(f"{name}: {len(lines)} lines")
        too_long += [f"{name}:{number}: {len(line)} characters" for number, line in enumerate(lines, 1)
                     if len(line) > MAX_LINE_CHARS]
        too_long += [f"{name}:{node.lineno}: {node.name}, {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not too_long, "\n".join(too_long)
