"""Predicted (roofline) against measured training-step time, one process, eager, with a
torch.profiler pass that attributes the measured time to the roofline's operation classes.

For each model shape and precision: the plan's roofline prediction (accounting/roofline/__init__.py, the
roof measured on this machine and cached: `lmforge plan --hardware this --remeasure`, with the
step's own matmul shapes timed alone: roofline/shapes.py; beside it, every matmul read off the
grid), then a few
real optimizer steps of lmforge's own engine (train/setup.py's build_engine and train/loop.py's
train_step, random tokens) timed after warm-up steps, then one profiled step whose operators are
sorted into the classes by name (CLASS_OF below; inside Optimizer.step: the optimizer) beside
each class's prediction, per step over --steps profiled steps.

    python bench/step_time.py [--models tiny,small,gpt2-124m] [--precisions fp32,bf16-mixed]
                              [--batch-size 8] [--seq-len N] [--steps 5] [--warmup 2] [--remeasure]

Under torchrun with data parallelism (ddp, zero2 on 2 CPU ranks): bench/step_time_dist.py.
"""

import argparse
import dataclasses
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# Operators, as the profiler names them, by roofline class: the leaf aten kernels (self time), so
# that a class's measured time is its kernels' time and what no class claims is "other" (Python,
# autograd bookkeeping, the launch cost the roofline counts per kernel).
CLASS_OF = [
    ("attention", ("attention", "sdpa", "flash")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("_foreach", "linalg_vector_norm", "aten::stack", "aten::clamp")),
    ("norms/elementwise", ("aten::", )),
]


def classify(name: str) -> str:
    for cls, keys in CLASS_OF:
        if any(key in name for key in keys):
            return cls
    return "other"


def build_parts(model: str, precision: str, batch: int, seq_len: int | None, extra: tuple = ()):
    """(config, engine, next batch, loss scaler, policy, device) of one shape: lmforge's engine on
    random tokens (`extra`: more overrides, e.g. train.parallel=ddp under torchrun:
    bench/step_time_dist.py)."""
    from lmforge.config import make_config
    from lmforge.modes import get_policy
    from lmforge.precision.policy import LossScaler
    from lmforge.train.setup import build_engine

    overrides = [f"train.precision={precision}", f"train.batch_size={batch}"]
    cfg = make_config(model, overrides=overrides + ([f"train.seq_len={seq_len}"] if seq_len else []) + list(extra))
    torch.manual_seed(0)
    policy, device = get_policy(precision), torch.device("cpu")
    engine = build_engine(cfg, policy, device)
    engine.model.train()
    scaler = LossScaler(enabled=policy.loss_scaling)
    generator = torch.Generator().manual_seed(0)

    def batch_of_tokens():
        w = torch.randint(0, cfg.model.vocab_size, (batch, cfg.seq_len + 1), generator=generator)
        return w[:, :-1], w[:, 1:]
    return cfg, engine, batch_of_tokens, scaler, policy, device


def build(model: str, precision: str, batch: int, seq_len: int | None, extra: tuple = ()):
    """(config, step callable) for one shape: build_parts's engine and train_step."""
    from lmforge.train.loop import train_step

    cfg, engine, batch_of_tokens, scaler, policy, device = build_parts(model, precision, batch, seq_len, extra)

    def step():
        train_step(engine, batch_of_tokens, cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip, scaler,
                   policy, device)
    return cfg, step


def measure(step, steps: int, warmup: int, at_least: float = 2.0) -> tuple[float, int]:
    """(median seconds, steps timed): `steps` optimizer steps after `warmup` untimed ones, more while
    the timed ones sum to less than `at_least` seconds (a 10 ms step: a median of 200, not of 5;
    under torchrun 0, so that every rank runs the same steps)."""
    for _ in range(warmup):
        step()
    times = []
    while len(times) < steps or sum(times) < at_least:
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2], len(times)


# Kernels the trace records as one call whatever they run inside (the zero-fill of NLL's
# gradient, the buffers of attention's backward): an operator below one of these is its class's.
ENCLOSING = ("attention", "sdpa", "flash", "log_softmax", "nll_loss", "cross_entropy", "aten::mm", "aten::addmm",
             "aten::bmm")


def class_of_event(event) -> str:
    """An operator's class: the optimizer's inside Optimizer.step (on CPU the foreach ops run as
    per-tensor aten kernels), else that of the innermost enclosing kernel of ENCLOSING (itself
    included), else its own name's."""
    parent, enclosing = event, None
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return "optimizer"
        if enclosing is None and any(key in parent.name for key in ENCLOSING):
            enclosing = parent.name
        parent = parent.cpu_parent
    return classify(enclosing or event.name)


def profiled(step, steps: int) -> dict:
    """Seconds per step of the kernels by roofline class (self CPU time of each operator, over
    `steps` profiled steps, sorted by class_of_event)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    by_class = defaultdict(float)
    for event in prof.events():
        by_class[class_of_event(event)] += event.self_cpu_time_total / 1e6 / steps
    return dict(by_class)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small,gpt2-124m")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remeasure", action="store_true", help="measure the roof again first")
    args = parser.parse_args()

    from lmforge.accounting.roofline.ops import predict_step
    from lmforge.accounting.roofline.shapes import this_step_roof
    from lmforge.cli.training import retain_freed_memory
    from lmforge.train.roofline import one_process_engine

    retain_freed_memory()  # as `lmforge train` (and `lmforge plan`) run
    device = torch.device("cpu")
    roof = this_step_roof(device, remeasure=args.remeasure)
    print(f"roof: {roof.name}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            cfg, step = build(model, precision, args.batch_size, args.seq_len)
            shaped = this_step_roof(device, one_process_engine, cfg)  # the step's own matmul shapes timed
            predicted = predict_step(one_process_engine, cfg, 1, shaped, "none")
            measured, timed = measure(step, args.steps, args.warmup)
            ratio = predicted["seconds_per_step"] / measured
            grid = dataclasses.replace(shaped, matmul_shapes={})
            grid_only = predict_step(one_process_engine, cfg, 1, grid, "none")
            print(f"\n{model} {precision} batch {args.batch_size} x seq {cfg.seq_len}: predicted "
                  f"{predicted['seconds_per_step'] * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms (median of "
                  f"{timed}), predicted/measured {ratio:.3f} (every matmul read off the grid instead: "
                  f"{grid_only['seconds_per_step'] / measured:.3f})")
            kernels = profiled(step, args.steps)
            print(f"  {'class':<20}{'predicted ms':>14}{'profiled ms':>14}{'ratio':>8}")
            for cls in [*predicted["classes"], "other"]:
                p = predicted["classes"].get(cls, {}).get("seconds", 0.0)
                m = kernels.get(cls, 0.0)
                print(f"  {cls:<20}{p * 1e3:>14.2f}{m * 1e3:>14.2f}{(p / m if m else float('nan')):>8.2f}")
            print(f"  (profiled kernels sum to {sum(kernels.values()) * 1e3:.1f} ms under the profiler's own cost)")


if __name__ == "__main__":
    main()
