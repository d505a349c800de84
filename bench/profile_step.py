"""Where a training step's time goes: torch.profiler's top operators for one side of
bench/throughput.py (the same step it times), so that a ratio that misses its target comes with
the reason beside it.

    python bench/profile_step.py [--side ours|reference] [--steps 5] [--rows 15] [key=value ...]
"""

import argparse
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import build_step  # noqa: E402 (beside this file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", default="ours", choices=["ours", "reference"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        step, loader = build_step(args.side, args)
        for _ in range(args.warmup):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        if loader is not None:
            loader.close()
    print(f"{args.side}, {args.steps} steps after {args.warmup} warm-up, {' '.join(args.overrides) or 'defaults'}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=38))


if __name__ == "__main__":
    main()
