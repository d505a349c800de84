"""Predicted (roofline) against measured time per aten operator of real training steps, timed in
this thread's CPU time, so that a machine other work loads still gives usable ratios.

bench/step_time.py compares whole steps and profiler classes in wall time: on a loaded machine the
time other processes hold the core lands in whatever ran then. Here the roof is measured and the
steps are timed with time.thread_time (CPU time of this thread only; on CPU with one thread the
forward, backward and optimizer all run on it), and a TorchDispatchMode times each aten operator
the step dispatches and prices it as ops.op_of prices the traced one (the same record:
name, tensors, phase). The mode's own Python costs each operator a few microseconds, in its
measured time (views and tiny ops read high); the first line gives the step's CPU time without it.
Scratch for finding a class's miss; bench/RESULTS.md's figures come from step_time.py idle.

    taskset -c 1 env OMP_NUM_THREADS=1 python bench/step_time_ops.py tiny fp32 [--batch-size 8] [--seq-len N] \
        [--steps 3] [--ops]
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmforge.accounting.roofline import op_time
from lmforge.accounting.roofline.ops import op_of, step_roof
from lmforge.accounting.roofline.trace import _BOOKKEEPING, Record, _meta


class _Clock(TorchDispatchMode):
    """Each aten operator's thread CPU time and predicted seconds, by (class, operator)."""

    def __init__(self, roof):
        super().__init__()
        self.roof, self.phase, self.rows = roof, "step", defaultdict(lambda: [0.0, 0.0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        started = time.thread_time()
        out = func(*args, **(kwargs or {}))
        seconds = time.thread_time() - started
        if func.namespace != "aten" or func._schema.name in _BOOKKEEPING:
            return out
        name = func._schema.name.removeprefix("aten::")
        inputs = tuple(_meta(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        outputs = tuple(_meta(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        view = func.is_view or name in ("_unsafe_view", "detach")
        calls = len(args[0]) if name.startswith("_foreach") else 1
        op = op_of(Record(name, self.phase, "", inputs, outputs, bool(view), calls))
        row = self.rows[(op.cls, name)]
        row[0] += op_time(self.roof, op)["seconds"]
        row[1] += seconds
        row[2] += op.calls
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("precision")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ops", action="store_true", help="a row per operator, not only per class")
    args = parser.parse_args()
    time.perf_counter = time.thread_time  # the roof's timings (measure) in CPU time too

    from step_time import build  # bench/step_time.py, beside this file (on the path: the script's folder)
    from lmforge.accounting.roofline.shapes import this_step_roof
    from lmforge.cli.training import retain_freed_memory
    from lmforge.train.roofline import one_process_engine

    retain_freed_memory()
    cfg, step = build(args.model, args.precision, args.batch_size, args.seq_len)
    # the roof and the step's own matmul calls, measured here (not cached), as predict_step prices them
    roof = this_step_roof(torch.device("cpu"), one_process_engine, cfg, remeasure=True, store=False)
    roof = step_roof(one_process_engine, cfg, 1, roof)
    clock = _Clock(roof)
    register_optimizer_step_pre_hook(lambda *_: setattr(clock, "phase", "optimizer"))
    register_optimizer_step_post_hook(lambda *_: setattr(clock, "phase", "step"))
    for _ in range(2):
        step()
    plain = []
    for _ in range(args.steps):
        started = time.thread_time()
        step()
        plain.append(time.thread_time() - started)
    with clock:
        for _ in range(args.steps):
            step()
    by_class = defaultdict(lambda: [0.0, 0.0])
    for (cls, _), (predicted, measured, _) in clock.rows.items():
        by_class[cls][0] += predicted / args.steps
        by_class[cls][1] += measured / args.steps
    print(f"{args.model} {args.precision}: step {sorted(plain)[len(plain) // 2] * 1e3:.2f} ms CPU time (median), "
          f"predicted {sum(p for p, _ in by_class.values()) * 1e3:.2f} ms")
    for cls, (predicted, measured) in sorted(by_class.items()):
        print(f"  {cls:<18} predicted {predicted * 1e3:9.2f} ms  measured {measured * 1e3:9.2f} ms  "
              f"ratio {predicted / measured:5.2f}")
    if args.ops:
        for (cls, name), (predicted, measured, calls) in sorted(clock.rows.items(), key=lambda kv: -kv[1][1]):
            print(f"    {cls:<18}{name[:44]:<45}{predicted / args.steps * 1e3:9.3f} {measured / args.steps * 1e3:9.3f}"
                  f" ms {calls // args.steps:6d} calls")


if __name__ == "__main__":
    main()
