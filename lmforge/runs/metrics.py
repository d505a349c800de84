"""metrics.jsonl: one JSON record per log or eval event, each with its `step`; written while a run
trains (train/report.py's StepLog), read here (no torch) by `lmforge runs`, the plots and resume."""

import json
from pathlib import Path

from lmforge.common.errors import LmforgeError


def lines_to_keep(path: Path, step: int, warn) -> list[str]:
    """The lines of metrics.jsonl `path` with records up to `step` (what a resume keeps: later ones
    belong to the part of the interrupted run that is being redone); reads only. A cut-off last
    line (what a full disk or a kill mid-write leaves) is dropped with a warning; damage elsewhere stops."""
    if not path.exists():
        return []
    records, cut = _read_lines(path, advice="; delete that line (or the file) and resume again")
    if cut:
        warn(f"{path} ends in a cut-off line (a full disk or a kill while writing it): dropped it")
    return [line for line, record in records if record.get("step", 0) <= step]


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A last line cut short (the run was killed while writing it)
    is left out; a damaged line before it is an error."""
    return [record for _, record in _read_lines(path)[0]]


def _read_lines(path: Path, advice: str = "") -> tuple[list[tuple[str, dict]], bool]:
    """(line, record) for each line of a metrics.jsonl, and whether a cut-off last line was left
    out; a damaged line before the last stops, followed by `advice`."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                return records, True
            raise LmforgeError(f"{path} line {number} is not JSON: the file is damaged{advice}") from None
        problem = _record_problem(record)
        if problem:
            raise LmforgeError(f"{path} line {number}: {problem}{advice}")
        records.append((line, record))
    return records, False


def _record_problem(record) -> str | None:
    """What is wrong with one metrics.jsonl record: not an object, a step that is no whole number,
    or a value where a number belongs that is no number (None: nothing)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, expected an object with a step"
    step = record.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool):
        return f"step is {step!r}, expected an integer"
    for key, value in record.items():
        if (key.endswith(("loss", "_per_s", "mfu")) and value is not None
                and (not isinstance(value, (int, float)) or isinstance(value, bool))):
            return f"{key} is {value!r}, expected a number"
    return None
