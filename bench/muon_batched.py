"""Newton-Schulz for every Muon matrix of a model, one 2-D iteration per matrix against one batched
iteration per shape (optim/muon.py's orthogonalize_all), timed alternately in one run; the outputs
are checked equal bit for bit first.

    OMP_NUM_THREADS=2 python bench/muon_batched.py [--model small] [--config recipes/speedrun.yaml] [--repeats 20]
"""

import argparse
import time

import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.muon import muon_param_groups, orthogonalize, orthogonalize_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--config", default="recipes/speedrun.yaml")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cfg = make_config(args.model, args.config)
    torch.manual_seed(0)
    matrices = muon_param_groups(Transformer(cfg.model), 0.0)[0]["params"]
    updates = [torch.randn(m.shape) for m in matrices]
    one_by_one = lambda: [orthogonalize(u) for u in updates]  # noqa: E731
    batched = lambda: orthogonalize_all(updates)  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(one_by_one(), batched())), "batched differs from 2-D"
    for _ in range(3):  # warm-up: the first calls pick kernels and allocate
        one_by_one(), batched()
    times = {"one by one": [], "batched": []}
    for _ in range(args.repeats):
        for name, fn in (("one by one", one_by_one), ("batched", batched)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    shapes = sorted({tuple(m.shape) for m in matrices})
    print(f"{args.model}: {len(matrices)} matrices in {len(shapes)} shapes {shapes}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    for name, t in median.items():
        print(f"  {name:>10}: {t * 1e3:7.1f} ms")
    print(f"  batched / one by one: {median['batched'] / median['one by one']:.3f}")


if __name__ == "__main__":
    main()
