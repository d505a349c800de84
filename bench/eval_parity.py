"""lmforge's multiple-choice scores against lm-eval's on any Hugging Face folder (e.g. a trained run
exported with `lmforge export RUN --format hf --out FOLDER`): tests/test_eval_parity.py's comparison
(per-request log-likelihoods, acc and acc_norm per question), without its check that some HellaSwag
context is truncated (a run's own tokenizer may truncate none).

    python bench/eval_parity.py FOLDER [--limit 200] [--dtype float32|float64] [--tasks arc_easy,hellaswag,piqa]

Prints one JSON line per task (questions, worst |dll|, truncated); stops at the first difference
beyond 1e-4 or the first question whose acc or acc_norm differs.
"""

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import test_eval_parity as parity  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--tasks", default="arc_easy,hellaswag,piqa")
    args = parser.parse_args()
    # the test's comparison as it is, less the test model's HellaSwag-truncation check
    source = inspect.getsource(parity.compare).replace(
        'assert truncated > 0, "no HellaSwag context was long enough to be truncated"', "pass")
    exec(source, parity.__dict__)
    parity.compare(args.folder, {task: args.limit for task in args.tasks.split(",")}, args.dtype)
