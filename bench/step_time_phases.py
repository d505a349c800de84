"""Where a small model's step time goes that no operator accounts for: each phase of
train/loop.py's train_step (next batch, forward + backward, clip, finite checks, optimizer step,
loss scaler, zero_grad), timed in this thread's CPU time, beside the aten operators it dispatches
and the roofline's price of them (the same pricing as bench/step_time_ops.py).

A phase's measured time less its operators' price is what the roofline misses there: Python
between operators, the optimizer wrapper's hooks, a host sync. The script runs the phases of
train_step one by one (the same calls in the same order, for one process's Engine) so each gets
its own clock; the step is also timed whole, to show the split adds up.

    taskset -c 1 env OMP_NUM_THREADS=1 python bench/step_time_phases.py tiny fp32 [--steps 200]
"""

import argparse
import dataclasses
import time
from collections import defaultdict

import torch

from lmforge.accounting.roofline import op_time
from lmforge.accounting.roofline.ops import op_of, step_ops, step_roof
from lmforge.accounting.roofline.trace import recorded


def phases(engine, next_batch, cfg, scaler, policy, device):
    """[(name, thunk)] of train_step's calls in its order (train/loop.py), state passed between them."""
    box = {}

    def fb():
        box["loss"] = engine.forward_backward(lambda: box["batch"], cfg.train.grad_accum, scaler, policy, device)

    def clip():
        box["found_inf"], box["norm"] = engine.unscale_and_clip(scaler, cfg.optim.grad_clip)

    def finite():
        loss = engine.mean_across_ranks(box["loss"])
        box["skipped"] = box["found_inf"] or not bool(torch.isfinite(loss) & torch.isfinite(box["norm"]))

    def set_lr():
        for group in engine.optimizer.param_groups:
            group["lr"] = cfg.optim.lr

    return [("set lr", set_lr), ("next batch", lambda: box.__setitem__("batch", next_batch())),
            ("forward+backward", fb), ("finish gradients", engine.finish_gradients), ("unscale+clip", clip),
            ("finite checks", finite), ("optimizer step", engine.step),
            ("scaler update", lambda: scaler.update(box["skipped"])), ("zero_grad", engine.zero_grad)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("precision")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    from step_time import build_parts  # bench/step_time.py, beside this file
    from lmforge.accounting.roofline.shapes import this_step_roof
    from lmforge.cli.training import retain_freed_memory
    from lmforge.train.roofline import one_process_engine
    from lmforge.train.step import train_step

    retain_freed_memory()
    cfg, engine, next_batch, scaler, policy, device = build_parts(args.model, args.precision, args.batch_size,
                                                                   args.seq_len)
    # as predict_step prices it
    roof = step_roof(one_process_engine, cfg, 1, this_step_roof(torch.device("cpu"), one_process_engine, cfg))
    steps = phases(engine, next_batch, cfg, scaler, policy, device)
    for _ in range(3):
        for _, thunk in steps:
            thunk()
    ops, priced = {}, {}
    for name, thunk in steps:  # one counted pass: the operators each phase dispatches, priced
        records = recorded(thunk)
        phase = "optimizer" if name in ("unscale+clip", "optimizer step") else "step"
        ops[name] = len(records)
        priced[name] = sum(op_time(roof, op_of(dataclasses.replace(r, phase=phase)))["seconds"] for r in records)
    seconds = defaultdict(list)
    whole = []
    for _ in range(args.steps):
        for name, thunk in steps:
            started = time.thread_time()
            thunk()
            seconds[name].append(time.thread_time() - started)
        started = time.thread_time()
        train_step(engine, next_batch, cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip, scaler, policy,
                   device)
        whole.append(time.thread_time() - started)
    median = {name: sorted(s)[len(s) // 2] for name, s in seconds.items()}
    predicted = sum(op_time(roof, op)["seconds"] for op in step_ops(one_process_engine, cfg, 1, "none"))
    print(f"{args.model} {args.precision}: train_step {sorted(whole)[len(whole) // 2] * 1e3:.3f} ms CPU time "
          f"(median of {args.steps}), its phases sum to {sum(median.values()) * 1e3:.3f} ms; the roofline "
          f"predicts {predicted * 1e3:.3f} ms; below, each operator priced with its launch")
    print(f"  {'phase':<18}{'aten ops':>9}{'priced ms':>11}{'measured ms':>13}{'unpriced ms':>13}")
    for name, _ in steps:
        print(f"  {name:<18}{ops[name]:>9}{priced[name] * 1e3:>11.3f}{median[name] * 1e3:>13.3f}"
              f"{(median[name] - priced[name]) * 1e3:>13.3f}")


if __name__ == "__main__":
    main()
