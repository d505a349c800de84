"""Which refinements of the roofline pay (issue 42): predicted / measured step time of the default
model (small, fp32 and bf16-mixed, 8 x 256) and GPT-2's shapes (gpt2-124m, 4 x 256), with each
refinement and without it, over `--repeats` rounds. Each round measures the roof anew (nothing
cached: the roof's own spread is part of the ratio's), times each case's own matmul calls, times
each case's real steps (bench/step_time.py's build and measure), and prices the step with every
variant below on that same roof: with and without alternate within a round, on one roof and one
measured step, so a variant's effect is paired and the round-to-round spread is the run's noise.
`uptime`'s load is printed with each round. The raw roofs and times go to --json, so other
variants can be priced afterwards without measuring again.

    OMP_NUM_THREADS=2 python bench/roof_spread.py [--repeats 4] [--json roofs.json]
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_time import build, measure  # noqa: E402

CASES = (("small", "fp32", 8, None), ("small", "bf16-mixed", 8, None), ("gpt2-124m", "fp32", 4, 256),
         ("gpt2-124m", "bf16-mixed", 4, 256))


def _same_family(roof, family: str):
    """Every elementwise family's grids replaced by `family`'s (binary: the add's)."""
    def one(grids):
        return {f: grids[family] for f in grids} if family in grids else grids
    return dataclasses.replace(roof, elementwise_ops=one(roof.elementwise_ops),
                               elementwise_ops_after=one(roof.elementwise_ops_after))


def _replace_family(roof, families: tuple, by: str = "binary"):
    def one(grids):
        return {f: grids[by] if f in families else g for f, g in grids.items()}
    return dataclasses.replace(roof, elementwise_ops=one(roof.elementwise_ops),
                               elementwise_ops_after=one(roof.elementwise_ops_after))


# name: roof -> roof. "full" is the model as it stands. Small's and GPT-2's steps write more than the
# cache, so "rates after writes -> cold" is 0 here by construction: tiny's training step and a decode
# step write less, and there the cold rates price them 1.6-2.6x slower (issue 42's report).
VARIANTS = {
    "full": lambda r: r,
    "matmul shapes timed -> grid": lambda r: dataclasses.replace(r, matmul_shapes={}),
    "rates after writes -> cold": lambda r: dataclasses.replace(r, elementwise_ops_after={}),
    "families -> add's rate": lambda r: _same_family(r, "binary"),
    "inplace -> binary": lambda r: _replace_family(r, ("binary_inplace",)),
    "elementwise -> copy bandwidth": lambda r: dataclasses.replace(r, elementwise_ops={}, elementwise_ops_after={},
                                                                   elementwise=[[1, r.bandwidth]]),
}


def load() -> str:
    return os.getloadavg().__repr__()


def predicted(roof, cfg, variant) -> float:
    from lmforge.accounting.roofline.ops import predict_step
    from lmforge.train.roofline import one_process_engine

    return predict_step(one_process_engine, cfg, 1, VARIANTS[variant](roof), "none")["seconds_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="", help="write every round's roof and times here")
    args = parser.parse_args()

    from lmforge.accounting.roofline.measure import _roof, measure_roof
    from lmforge.accounting.roofline.ops import step_matmul_shapes, step_writes
    from lmforge.accounting.roofline.shapes import at_writes, timed_rates, writes_before
    from lmforge.cli.training import retain_freed_memory
    from lmforge.train.roofline import one_process_engine

    retain_freed_memory()  # as `lmforge train` runs
    device = torch.device("cpu")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    rounds = []
    ratios = {}  # (case, variant) -> [ratio per round]
    for i in range(args.repeats):
        started, load_before = time.perf_counter(), load()
        fields = measure_roof(device)
        base = _roof(device, fields)
        this_round = {"roof": fields, "load_before": load_before, "cases": {}}
        line = []
        for model, precision, batch, seq_len in CASES:
            name = f"{model} {precision}"
            cfg, step = build(model, precision, batch, seq_len)
            after = writes_before(step_writes(one_process_engine, cfg, 1, base), base.cache_bytes)
            rates = timed_rates(base, step_matmul_shapes(one_process_engine, cfg), after, device, {})
            roof = dataclasses.replace(base, matmul_shapes=at_writes(rates, after))
            measured, timed = measure(step, args.steps, 3)
            this_round["cases"][name] = {"matmul_shapes": rates, "after": after, "measured_s": measured,
                                         "steps": timed, "load": load()}
            for variant in VARIANTS:
                ratios.setdefault((name, variant), []).append(predicted(roof, cfg, variant) / measured)
            line.append(f"{name} {measured * 1e3:.0f} ms, ratio {ratios[name, 'full'][-1]:.3f}")
        this_round["seconds"] = time.perf_counter() - started
        rounds.append(this_round)
        print(f"round {i} ({this_round['seconds']:.0f} s, load {load_before} -> {load()}): " + "; ".join(line),
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rounds))
    print(f"\n{'variant':<32}" + "".join(f"{f'{m} {p}':>26}" for m, p, _, _ in CASES))
    for variant in VARIANTS:
        cells = []
        for model, precision, _, _ in CASES:
            r = ratios[f"{model} {precision}", variant]
            full = ratios[f"{model} {precision}", "full"]
            effect = sum(a - b for a, b in zip(full, r)) / len(r)
            cells.append(f"{min(r):.3f}-{max(r):.3f} ({effect:+.3f})")
        print(f"{variant:<32}" + "".join(f"{c:>26}" for c in cells))
    print("cells: min-max of predicted/measured over the rounds (mean of with minus without, paired by round); "
          "spread = the full row's max - min")


if __name__ == "__main__":
    main()
