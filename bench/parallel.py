"""Data-parallel strategies side by side on this machine: 2 ranks (gloo), each strategy of
train.parallel trained a few steps on random tokens. Per strategy: step time, tokens/s (all ranks),
per-rank bytes of parameters, gradients, optimizer states (master weights included) and
activations, planned (accounting/) beside measured, and bytes sent per step per rank, formula
(accounting/comm.py) beside counted (parallel/comm.py; fsdp's own collectives are not counted).
Writes a table to stdout and bench/parallel_memory.png.

    nice -n 10 python bench/parallel.py [--model tiny] [--steps 10] [--precision fp32]

With --layouts: tensor, sequence, context and pipeline layouts instead (bench/parallel_layouts.py,
its options after it), per rank, the trainer's own predicted-vs-measured table.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
ROWS, SEQ = 8, 64


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from lmforge.accounting.measure import measure_saved_bytes
    from lmforge.config import make_config
    from lmforge.precision.policy import LossScaler
    from lmforge.modes import get_policy
    from lmforge.train.loop import train_step
    from lmforge.train.setup import build_engine

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for strategy in STRATEGIES:
        cfg = make_config(args.model, overrides=[f"train.parallel={strategy}", f"train.precision={args.precision}",
                                                 f"train.batch_size={ROWS}", f"train.seq_len={SEQ}"])
        torch.manual_seed(0)
        policy = get_policy(cfg.train.precision)
        engine = build_engine(cfg, policy)
        scaler = LossScaler(enabled=policy.loss_scaling)
        g = torch.Generator().manual_seed(rank)

        def batch():
            t = torch.randint(0, cfg.model.vocab_size, (ROWS, SEQ + 1), generator=g)
            return t[:, :-1], t[:, 1:]

        held, saved = {}, {}
        zero_grad = engine.zero_grad
        engine.zero_grad = lambda: (held.update(engine.state_bytes()) if not held else None, zero_grad())
        forward = engine.model.forward

        def measured_forward(*a, **k):  # what the first micro-batch saves for backward
            if saved:
                return forward(*a, **k)
            # parameters that exist here as plain tensors (ZeRO-3's freed ones and FSDP's DTensors do not)
            params = [p for p in engine.model.parameters()
                      if not hasattr(p, "to_local") and p.untyped_storage().nbytes() > 0]
            with measure_saved_bytes(params) as s:
                out = forward(*a, **k)
            saved["activations"] = s.activations
            return out
        engine.model.forward = measured_forward
        times = []
        for step in range(args.steps + 1):  # the first step warms up and is not timed
            if step == 1 and engine.comm is not None:
                engine.comm.reset()
            dist.barrier()
            start = time.perf_counter()
            train_step(engine, batch, 1, cfg.optim.lr, cfg.optim.grad_clip, scaler, policy, torch.device("cpu"))
            times.append(time.perf_counter() - start)
        step_s = sorted(times[1:])[len(times[1:]) // 2]
        sent = engine.comm.sent_bytes() / args.steps if engine.comm is not None and strategy != "fsdp" else None
        results[strategy] = {"step_s": step_s, "tokens_per_s": dist.get_world_size() * ROWS * SEQ / step_s,
                             "held": held, "activations": saved.get("activations"), "sent": sent}
        del engine
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def plan_of(model: str, strategy: str, precision: str) -> dict:
    from lmforge.accounting.plan.make import Costing, make_plan
    from lmforge.config import make_config
    cfg = make_config(model, overrides=[f"train.parallel={strategy}", f"train.precision={precision}",
                                        f"train.batch_size={ROWS}", f"train.seq_len={SEQ}"])
    return make_plan(cfg, Costing(dp=2), ("this", 1e12, 1e12))


def main() -> None:
    if "--layouts" in sys.argv[1:]:
        sys.path.insert(0, str(Path(__file__).parent))
        from parallel_layouts import main as layouts
        return layouts(sys.argv[1:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", default="")
    parser.add_argument("--rank-main", action="store_true")
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    out = Path("/tmp") / f"lmforge-bench-parallel-{os.getpid()}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    __file__, "--rank-main", "--model", args.model, "--steps", str(args.steps),
                    "--precision", args.precision, "--out", str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = json.loads(out.read_text())
    mib = 2**20
    print(f"model {args.model}, {args.precision}, 2 ranks x {ROWS} x {SEQ} tokens, median of {args.steps} steps")
    print(f"{'strategy':9} {'step ms':>8} {'tok/s':>8} | per rank MiB planned/measured: {'params':>13} "
          f"{'grads':>13} {'optim+master':>13} {'activations':>13} | sent KiB/step planned/counted")
    bars = {}
    for strategy, r in results.items():
        plan = plan_of(args.model, strategy, args.precision)
        b, held = plan["memory"]["breakdown_bytes"], r["held"]
        act_plan = plan["memory"]["breakdown_bytes"]["activations"] + b["weight_copies"]
        planned = [b["parameters"], b["gradients"], b["optimizer_states"] + b["master_weights"], act_plan]
        measured = [held["parameters"], held["gradients"], held["optimizer_states"] + held["master_weights"],
                    r["activations"]]
        bars[strategy] = (planned, measured)
        cells = " ".join(f"{p / mib:6.2f}/{m / mib:6.2f}" for p, m in zip(planned, measured))
        sent = f"{r['sent'] / 1024:.1f}" if r["sent"] is not None else "not counted"
        print(f"{strategy:9} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:8.0f} | {cells} | "
              f"{plan['communication']['sent_bytes'] / 1024:.1f}/{sent}")
    plot(bars, Path(__file__).with_name("parallel_memory.png"), args)


def plot(bars: dict, path: Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = ["parameters", "gradients", "optimizer + master", "activations"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = 0
    ticks = []
    for strategy, (planned, measured) in bars.items():
        for offset, values, hatch in ((0, planned, "//"), (1, measured, "")):
            bottom = 0
            for i, value in enumerate(values):
                ax.bar(x + offset, value / 2**20, bottom=bottom, color=f"C{i}", hatch=hatch, edgecolor="white",
                       label=labels[i] if x == 0 and offset == 1 else None)
                bottom += value / 2**20
        ticks += [(x, f"{strategy}\nplan"), (x + 1, "measured")]
        x += 3
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"per-rank memory, 2 ranks, {args.model}, {args.precision}: plan (hatched) vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
