"""Seconds from launching `lmforge train` to its first training step, with an empty cache folder.

    python bench/startup.py [--runs 3] [--dir bench/out/startup] [key=value ...]

The data is prepared once in DIR first (`lmforge prepare`, not timed). Each run then starts
`lmforge train` (the default model unless overridden) in DIR as a new process with
XDG_CACHE_HOME pointing at an empty folder, so the matmul peak is measured as on a new machine;
the process is stopped at the first call of `train_step` (a wrapper replaces it before the
trainer imports it) and the wall time from launch to that call is printed, with the process's
CPU time (user + system). The run folders it leaves are deleted.
"""

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = """
import os, sys, time
import lmforge.train.step as step
def first(*args, **kwargs):
    print(f"FIRST_STEP {time.time():.6f}", file=sys.stderr, flush=True)
    os._exit(0)
step.train_step = first
from lmforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def one_run(folder: Path, overrides: list[str]) -> tuple[float, float]:
    """(seconds from launch to the first step, CPU seconds of the process) for one launch."""
    with tempfile.TemporaryDirectory() as cache:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.time()
        result = subprocess.run([sys.executable, "-c", WRAPPER, "train", "--name", "startup", *overrides],
                                cwd=folder, env={**os.environ, "XDG_CACHE_HOME": cache}, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(folder / "runs" / "startup", ignore_errors=True)
    stamps = re.findall(r"FIRST_STEP ([0-9.]+)", result.stderr)  # the progress bar may share its line
    if not stamps:
        raise SystemExit(f"no first step (exit {result.returncode}):\n{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(stamps[0]) - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="bench/out/startup")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    folder = Path(args.dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", *args.overrides], cwd=folder, check=True,
                   capture_output=True)
    runs = [one_run(folder, args.overrides) for _ in range(args.runs)]
    for i, (wall, cpu) in enumerate(runs, 1):
        print(f"run {i}: first step {wall:.2f} s after launch (CPU {cpu:.2f} s)")
    walls = [wall for wall, _ in runs]
    print(f"min {min(walls):.2f} s, median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")


if __name__ == "__main__":
    main()
