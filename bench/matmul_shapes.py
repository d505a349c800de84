"""A model's matmul shapes timed alone against the roof's matmul grid read at those shapes: where
the grid (three points a dimension, up to 1024: measure.MATMUL_DIMS) misses the rate a
shape runs at. GPT-2 124M's shapes at 4 x 256 tokens by default: the fused QKV, attention output,
MLP in and out, the head, and the weight gradients' transposed forms.

    OMP_NUM_THREADS=2 python bench/matmul_shapes.py [--repeats 5]
"""

import argparse
import time

import torch

# (M, N, K) of GPT-2 124M at 1024 tokens: forward, and the backward's weight-gradient forms
GPT2_SHAPES = ((1024, 768, 768), (1024, 2304, 768), (1024, 3072, 768), (1024, 768, 3072), (1024, 50257, 768),
               (768, 768, 1024), (50257, 768, 1024), (1024, 768, 50257))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from lmforge.accounting.roofline import interpolate
    from lmforge.accounting.roofline.measure import DTYPES, this_roof

    roof = this_roof(torch.device("cpu"))
    print(f"roof: {roof.name}; the best of {args.repeats} calls per shape")
    for name, dtype in DTYPES.items():
        for m, n, k in GPT2_SHAPES:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            a @ b  # warm-up
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - started)
            measured = 2 * m * n * k / best
            grid = interpolate(roof.matmul[name], (m, n, k))
            print(f"{name:<9} {str((m, n, k)):<20} measured {measured / 1e12:5.2f} TFLOP/s  grid {grid / 1e12:5.2f}  "
                  f"grid/measured {grid / measured:.2f}")


if __name__ == "__main__":
    main()
