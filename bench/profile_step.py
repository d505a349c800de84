"""Where a training step's time goes: torch.profiler's top operators for one side of
bench/throughput.py (the same step it times, on the same shape), so that a ratio that misses its
target comes with the reason beside it.

    python bench/profile_step.py [--side ours|reference|ours compiled|reference compiled]
                                 [--shape default|gpt2] [--steps 5] [--warmup 3] [--rows 15] [key=value ...]
"""

import argparse
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import SHAPES, SIDES, build_step  # noqa: E402 (beside this file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", default="ours", choices=SIDES)
    parser.add_argument("--shape", default="default", choices=SHAPES)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile happens here)")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data

    shape = [*SHAPES[args.shape], *args.overrides]
    args.overrides = [*shape, f"data.dir={prepare_data(make_config('small', overrides=shape)).dir}"]
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
    print(f"{args.side}, shape {args.shape}, {args.steps} steps after {args.warmup} warm-up, "
          f"{' '.join(args.overrides)}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=38))


if __name__ == "__main__":
    main()
