"""Predicted (roofline) against measured training-step time on N ranks under torchrun: gloo on
CPU, train.parallel=ddp and zero2, one CPU thread per rank.

For each strategy, on every rank: lmforge's engine of that strategy and its train_step (random
tokens, as bench/step_time.py), timed after warm-up steps (median); then the same micro-batch on
the same ranks at the same time with no communication (train.parallel=none: each rank steps alone,
as busy as in the real run), so that the measured difference is the communication the step did not
hide. The prediction is the trainer's: the plan's roofline on this machine's roof with all-reduce
measured on the launched group (bench/collectives.py), its communication added in
full (no overlap assumed). Printed by rank 0: predicted and measured step, their ratio, and the
communication predicted beside the measured exposed part (1 - exposed / predicted: the share of the
collectives' time that overlapped compute), and the ratio with every matmul read off the roof's grid
instead of the step's own calls timed (roofline/shapes.py). Then, by strategy, each
collective operator's price beside the time it held rank 0 in a timed step (the median over the
steps: CollectiveClock), and the exposed time no collective held.

    python bench/step_time_dist.py [--nproc 2] [--parallel ddp,zero2] [--models tiny,small]
                                   [--batch-size 8] [--steps 5] [--warmup 2] [--remeasure]
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_time import build_parts  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--parallel", default="ddp,zero2")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remeasure", action="store_true", help="measure the roof again first (rank 0)")
    return parser.parse_args()


def launch() -> None:
    """Run this script under torchrun on --nproc ranks (one CPU thread each), with the same options."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={parse().nproc}",
               f"--master_port={port}", __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


def timed(model: str, args, strategy: str) -> tuple:
    """(config, median seconds per step, {collective: seconds it held this rank per step}) of
    `strategy` on every rank at once."""
    import torch.distributed as dist

    from lmforge.train.loop import train_step

    cfg, engine, batch_of_tokens, scaler, policy, device = build_parts(model, args.precision, args.batch_size, None,
                                                                      (f"train.parallel={strategy}",))
    clock = CollectiveClock(engine.comm) if engine.comm is not None else None

    def step():
        train_step(engine, batch_of_tokens, cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip, scaler,
                   policy, device)

    dist.barrier()
    times = measure_together(step, args.steps, args.warmup, clock)
    held = clock.median() if clock else {}
    return cfg, sorted(times)[len(times) // 2], held


class CollectiveClock:
    """The time a rank is held by each collective operator in its steps: a synchronous call's
    duration, an asynchronous one's launch and the time its wait() blocks, summed by operator
    (scalar all-reduces apart) over a step (`lap` ends one), wrapped around the engine's
    Collectives (parallel/comm.py), through which every collective of a step goes. `median()`:
    each operator's median over the steps, as the step time is a median (a mean takes in the few
    steps that stall for milliseconds on this VM)."""

    OPERATORS = ("all_reduce", "reduce_scatter", "all_gather")

    def __init__(self, comm):
        self.held, self.steps = defaultdict(float), []
        for name in self.OPERATORS:
            setattr(comm, name, self._timed(name, getattr(comm, name)))

    def lap(self) -> None:
        self.steps.append(dict(self.held))
        self.held.clear()

    def median(self) -> dict:
        names = {name for step in self.steps for name in step}
        return {name: sorted(step.get(name, 0.0) for step in self.steps)[len(self.steps) // 2] for name in names}

    def _timed(self, name, call):
        def timed(*args, **kwargs):
            scalar = name == "all_reduce" and args[0].numel() == 1
            key = "scalar_all_reduce" if scalar else name
            started = time.perf_counter()
            work = call(*args, **kwargs)
            self.held[key] += time.perf_counter() - started
            return self._Wait(work, self.held, key) if work is not None else None
        return timed

    class _Wait:
        def __init__(self, work, held, key):
            self.work, self.held, self.key = work, held, key

        def wait(self):
            started = time.perf_counter()
            done = self.work.wait()
            self.held[self.key] += time.perf_counter() - started
            return done


def measure_together(step, steps: int, warmup: int, clock=None, at_least: float = 2.0) -> list:
    """step_time.measure on every rank at once: at least `steps` timed steps, more until every rank's
    sum to `at_least` seconds (tiny's 12 ms step: a median of ~170, where 20 read 0.95-1.25 of the
    prediction from run to run), the ranks agreeing after each step (outside the timing) so that
    all of them run as many."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    if clock is not None:
        clock.held.clear()  # the timed steps' only (the agreement below is not through the engine)
    times = []
    while True:
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        if clock is not None:
            clock.lap()
        if len(times) >= steps:
            enough = torch.tensor([float(sum(times) >= at_least)])
            dist.all_reduce(enough, op=dist.ReduceOp.MIN)
            if enough.item():
                return times


def main() -> None:
    args = parse()
    import torch.distributed as dist

    from collectives import measure_collective
    from lmforge.accounting.roofline.ops import predict_step
    from lmforge.accounting.roofline.shapes import this_step_roof
    from lmforge.config import make_config
    from lmforge.cli.training import retain_freed_memory
    from lmforge.train.roofline import one_process_engine

    retain_freed_memory()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    roofs = {}  # rank 0 measures the roof and times each step's own matmul calls while the others wait
    if rank == 0:
        roof = this_step_roof(device, remeasure=args.remeasure)
        for model in args.models.split(","):
            for strategy in args.parallel.split(","):
                cfg = make_config(model, overrides=[f"train.precision={args.precision}",
                                                    f"train.batch_size={args.batch_size}", f"train.parallel={strategy}"])
                roofs[model, strategy] = this_step_roof(device, one_process_engine, cfg, world)
    dist.barrier()
    collective = measure_collective()
    if rank == 0:
        measured = ", ".join(f"{name} {c['latency_s'] * 1e6:.0f} us + {c['bytes_per_second'] / 1e9:.2f} GB/s"
                             for name, c in collective["operators"].items())
        print(f"roof: {roof.name}; {world} ranks on {collective['backend']}: {measured}")
        print(f"{'model':<8}{'strategy':<9}{'predicted ms':>13}{'measured ms':>12}{'pred/meas':>10}"
              f"{'comm pred ms':>13}{'exposed ms':>11}{'hidden':>8}{'grid':>8}")
    attribution = []
    for model in args.models.split(","):
        _, alone, _ = timed(model, args, "none")
        for strategy in args.parallel.split(","):
            cfg, measured, held = timed(model, args, strategy)  # every rank builds and steps (collectives)
            if rank:
                continue
            measured_roof = dataclasses.replace(roofs[model, strategy], collective=collective)
            predicted = predict_step(one_process_engine, cfg, world, measured_roof, strategy)
            grid_roof = dataclasses.replace(measured_roof, matmul_shapes={})
            grid = predict_step(one_process_engine, cfg, world, grid_roof, strategy)
            comm = predicted["classes"].get("communication", {}).get("seconds", 0.0)
            exposed = measured - alone
            print(f"{model:<8}{strategy:<9}{predicted['seconds_per_step'] * 1e3:>13.1f}{measured * 1e3:>12.1f}"
                  f"{predicted['seconds_per_step'] / measured:>10.3f}{comm * 1e3:>13.1f}{exposed * 1e3:>11.1f}"
                  f"{(1 - exposed / comm if comm else float('nan')):>8.0%}"
                  f"{grid['seconds_per_step'] / measured:>8.3f}")
            attribution.append(attribute(cfg, world, measured_roof, strategy, held, exposed))
    if rank == 0:
        print("\nthe exposed time by collective: priced (calls per step) against the time it held rank 0 in a "
              "step (median)")
        for line in attribution:
            print(line)
    dist.destroy_process_group()


def attribute(cfg, dp: int, roof, strategy: str, held: dict, exposed: float) -> str:
    """One line: each collective operator's price (ops.collective_ops at the roof's
    measured figures) beside the time it held the rank in the timed steps (CollectiveClock), and
    what of the exposed time no collective held (the engine's hooks, copies and fills, and compute
    slowed by the collectives' threads)."""
    from lmforge.accounting.roofline import op_time
    from lmforge.accounting.roofline.ops import collective_ops

    parts = []
    for op in collective_ops(cfg, dp, strategy):
        name = "scalar_all_reduce" if "scalar" in op.name else op.op
        parts.append(f"{name} x{op.calls} {op_time(roof, op)['seconds'] * 1e3:.2f}/{held.get(name, 0.0) * 1e3:.2f} ms")
    rest = exposed - sum(held.values())
    return (f"  {cfg.model.n_layers}-layer {strategy:<6} " + ", ".join(parts)
            + f"; held by none of them {rest * 1e3:.2f} ms")


if __name__ == "__main__":
    if "RANK" not in os.environ:
        launch()
    else:
        main()
