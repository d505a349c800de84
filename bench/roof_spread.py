"""How much this machine's roof moves from one measurement to the next: the roof measured
`--roofs` times in a row (nothing cached), and each time the plan's predicted step of tiny (fp32 and
bf16-mixed) and small (fp32), with its norms/elementwise and matmuls classes. A prediction can be no
steadier than the roof it reads.

    OMP_NUM_THREADS=2 python bench/roof_spread.py [--roofs 4]
"""

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roofs", type=int, default=4)
    args = parser.parse_args()

    from lmforge.accounting.roofline.measure import _roof, measure_roof
    from lmforge.accounting.roofline.ops import predict_step
    from lmforge.config import make_config
    from lmforge.train.roofline import one_process_engine

    device = torch.device("cpu")
    cases = []
    for model, precision in (("tiny", "fp32"), ("tiny", "bf16-mixed"), ("small", "fp32")):
        cfg = make_config(model, overrides=[f"train.precision={precision}", "train.batch_size=8"])
        cases.append((f"{model} {precision}", cfg))
    for i in range(args.roofs):
        started = time.perf_counter()
        roof = _roof(device, measure_roof(device))
        took = time.perf_counter() - started
        rows = []
        for name, cfg in cases:
            p = predict_step(one_process_engine, cfg, 1, roof, "none")
            classes = p["classes"]
            rows.append(f"{name} {p['seconds_per_step'] * 1e3:.2f} ms (norms/elementwise "
                        f"{classes['norms/elementwise']['seconds'] * 1e3:.2f}, "
                        f"matmuls {classes['matmuls']['seconds'] * 1e3:.2f})")
        print(f"roof {i} ({took:.0f} s): " + " | ".join(rows), flush=True)


if __name__ == "__main__":
    main()
