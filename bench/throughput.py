"""Training throughput of lmforge beside the same model in plain PyTorch, in one run.

    python bench/throughput.py [--steps 10] [--warmup 3] [--shapes default,gpt2] [--pairs eager,compiled]
                               [--precisions fp32,bf16-mixed] [key=value ...]
    python bench/throughput.py --optimizer-only [--steps 30] [--warmup 3]   # only the optimizer table

Rows: each shape (`default`: preset `small`, context 256; `gpt2`: GPT-2-124M's shape, 12 layers,
d_model 768, 12 heads, vocabulary 50257, context 1024, in the llama family that the reference
implements, batch 1) in each precision (fp32, bf16-mixed), and in each row four sides, each in a
process of its own, as a user would run it:
  ours              `lmforge train`'s Trainer: Transformer, hand-written AdamW, clipping, schedule,
                    prefetching loader, glibc malloc told to keep freed memory (cli/training.py)
  ours compiled     the same with train.compile=true
  reference         bench/reference_llama.py (torch.nn layers, nn.RMSNorm, SDPA), torch.optim.AdamW
                    (foreach), batches drawn in the loop, torch.autocast for bf16-mixed
  reference compiled   torch.compile(model), as its tutorials do
The sides are compared in pairs (ours and the reference, eager; then both compiled), the two
processes of a pair alive together and taking steps in lockstep: ours, reference, reference, ours,
... (the first of each round alternating), so that whatever else the machine is doing hits both
alike; on a shared machine that is what keeps the ratio meaningful when the absolute figures are
not. Each side reports the median of its `--steps` timed steps after `--warmup` untimed ones (the
compile happens in the warm-up). Printed: tokens/s, the fraction of this machine's measured
matmul peak of the dtype the matmuls run in (accounting/hardware.py; analytic FLOPs per token from
lmforge.accounting.shapes), peak resident memory, minor page faults per step, the loader wait, and
the ratios ours / reference, eager against eager and compiled against compiled.

Then, in the same run (or alone with `--optimizer-only`), the time of one optimizer step on the
model's parameters with random gradients: lmforge's AdamW on its per-parameter loop and on its
foreach path, and torch.optim.AdamW(foreach=True), taking steps in turns; medians of `--steps`.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIDES = ("ours", "reference", "ours compiled", "reference compiled")
PAIRS = {"eager": ("ours", "reference"), "compiled": ("ours compiled", "reference compiled")}
# GPT-2-124M's shape (Radford et al. 2019) in the llama family, which the reference implements. Each
# shape trains on its own data folder, the default one for its vocabulary: the embedded corpus
# (31.5 MB) is enough for the BPE trainer to learn all 50257 tokens (about 20 s to prepare, once).
SHAPES = {"default": [], "gpt2": ["model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=12",
                                 "model.vocab_size=50257", "model.max_seq_len=1024", "train.batch_size=1"]}


def build_step(side: str, args):
    """A callable running one optimizer step of `side`, and the data loader (ours) or None."""
    import numpy as np
    import torch
    from rich.console import Console

    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data
    from lmforge.optim.clip import clip_grad_norm

    compiled = side.endswith("compiled")
    cfg = make_config("small", overrides=args.overrides + ["train.sample_tokens=0", "train.max_steps=100000"]
                      + (["train.compile=true"] if compiled and side.startswith("ours") else []))
    if side.startswith("ours"):
        from lmforge.cli.training import retain_freed_memory
        from lmforge.train.loop import Trainer

        retain_freed_memory()  # as `lmforge train` does; each side runs in a process of its own
        trainer = Trainer(cfg, Path(args.scratch) / f"ours-{time.time_ns()}", console=Console(quiet=True),
                          progress=False)
        trainer.model.train()
        return trainer.train_step, trainer.loader

    from reference_llama import ReferenceLlama

    t, m = cfg.train, cfg.model
    torch.manual_seed(t.seed)
    data = prepare_data(cfg, log=lambda _: None)
    model = ReferenceLlama(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim,
                           m.max_seq_len, m.rope_theta, m.norm_eps)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.optim.lr,
                            betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, foreach=True)
    forward = torch.compile(model) if compiled else model
    bf16 = t.precision == "bf16-mixed"
    rng = np.random.default_rng(0)

    def step():
        for _ in range(t.grad_accum):
            starts = rng.integers(0, len(data.train) - cfg.seq_len, size=t.batch_size)
            w = torch.from_numpy(np.stack([data.train[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = forward(w[:, :-1], w[:, 1:])
            (loss / t.grad_accum).backward()
        clip_grad_norm(model.parameters(), cfg.optim.grad_clip)  # the same clipping cost on both sides
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, None


def serve(side: str, args) -> None:
    """The side's own process: build it, then take one step per line on stdin ("warm": untimed,
    "step": timed), answering "done" after each, until "end": then print what the timed steps
    measured, as JSON."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel; stray prints go to stderr
    os.dup2(2, 1)
    step, loader = build_step(side, args)

    def counters() -> tuple[float, int, float]:
        return (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                loader.wait_seconds if loader else 0.0)

    seconds, faults, waited = [], 0, 0.0
    for command in map(str.strip, sys.stdin):
        if command == "end":
            break
        before = counters()
        step()
        if command == "step":
            after = counters()
            seconds.append(after[0] - before[0])
            faults += after[1] - before[1]
            waited += after[2] - before[2]
        reply.write("done\n")
    if loader:
        loader.close()
    reply.write(json.dumps({"median_step_seconds": statistics.median(seconds), "faults_per_step": faults / len(seconds),
                            "loader_wait_fraction": waited / sum(seconds) if loader else None,
                            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}) + "\n")


def run_pair(pair: tuple[str, str], overrides: list[str], args) -> dict[str, dict]:
    """Both sides of `pair` in their own processes, stepping in lockstep (see the docstring);
    each side's stderr goes to a log in the scratch folder."""
    logs = {side: Path(args.scratch) / f"{side.replace(' ', '-')}.log" for side in pair}
    procs = {}
    try:
        for side in pair:
            with open(logs[side], "w") as log:
                procs[side] = subprocess.Popen([sys.executable, __file__, "--side", side, "--scratch", args.scratch,
                                                *overrides], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=log, text=True, bufsize=1)

        def ask(side: str, command: str) -> str:
            procs[side].stdin.write(command + "\n")
            answer = procs[side].stdout.readline()
            if not answer:
                procs[side].wait()
                last = (logs[side].read_text().strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"the {side!r} side failed ({last}): see {logs[side]}")
            return answer

        for index in range(args.warmup + args.steps):
            for side in (pair if index % 2 == 0 else pair[::-1]):
                ask(side, "warm" if index < args.warmup else "step")
        return {side: json.loads(ask(side, "end")) for side in pair}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


OPTIMIZERS = ("lmforge loop", "lmforge foreach", "torch foreach")


def optimizer_step_seconds(args) -> tuple[dict[str, float], list]:
    """Median seconds of one step of each optimizer over its own copy of the model's parameters,
    and the parameters of one copy."""
    import torch

    from lmforge.config import make_config
    from lmforge.model.transformer import Transformer
    from lmforge.optim.adamw import AdamW
    from lmforge.cli.training import retain_freed_memory
    from lmforge.parallel.world import resolve_device
    from lmforge.optim.build import weight_decay_groups

    cfg = make_config(args.model, overrides=args.overrides)
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":
        retain_freed_memory()  # as the Trainer does
    o = cfg.optim
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    build = {"lmforge loop": lambda groups: AdamW(groups, foreach=False, **hyper),
             "lmforge foreach": lambda groups: AdamW(groups, foreach=True, **hyper),
             "torch foreach": lambda groups: torch.optim.AdamW(groups, foreach=True, **hyper)}
    optimizers = {}
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = Transformer(cfg.model).to(device)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizers[name] = build[name](weight_decay_groups(model, o.weight_decay))
    seconds = {name: [] for name in OPTIMIZERS}
    for index in range(args.warmup + args.steps):
        for name, optimizer in optimizers.items():  # in turns, so that drift of the machine hits all alike
            started = time.perf_counter()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= args.warmup:
                seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in seconds.items()}, list(model.parameters())


def print_optimizer_steps(args) -> None:
    seconds, params = optimizer_step_seconds(args)
    print(f"optimizer step on preset {' '.join([args.model, *args.overrides])} ({sum(p.numel() for p in params) / 1e6:.2f}M "
          f"parameters in {len(params)} tensors, {params[0].device}): median of {args.steps} after "
          f"{args.warmup} warm-up, optimizers in turns")
    for name in OPTIMIZERS:
        print(f"{name:22} {seconds[name] * 1e3:>9.1f} ms  {seconds[name] / seconds['lmforge loop']:>6.3f} of the loop")
    print(f"ratio lmforge foreach/torch foreach: {seconds['lmforge foreach'] / seconds['torch foreach']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile happens here)")
    parser.add_argument("--pairs", default="eager,compiled", help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--shapes", default="default,gpt2", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--model", default="small", help="the preset of --optimizer-only")
    parser.add_argument("--scratch", default=str(Path(__file__).resolve().parent / "out"),
                        help="where runs write their files (default bench/out, untracked)")
    parser.add_argument("--optimizer-only", action="store_true", help="time only the optimizer step")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    if args.side:
        serve(args.side, args)
        return
    if args.optimizer_only:
        print_optimizer_steps(args)
        return

    import torch

    from lmforge.accounting.shapes import training_flops_per_token
    from lmforge.accounting.hardware import device_name, matmul_peak
    from lmforge.accounting.plan.make import matmul_dtype
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data

    # Once per shape, outside any timing; a folder is tied to one vocabulary (prepare refuses another).
    data_dirs = {shape: prepare_data(make_config("small", overrides=[*SHAPES[shape], *args.overrides])).dir
                 for shape in args.shapes.split(",")}
    print(f"machine: {device_name(torch.device('cpu'))}, torch {torch.__version__}; medians of {args.steps} timed steps "
          f"after {args.warmup} warm-up (compile included), ours and the reference in lockstep")
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            overrides = [*SHAPES[shape], f"data.dir={data_dirs[shape]}", f"train.precision={precision}", *args.overrides]
            cfg = make_config("small", overrides=overrides)
            dtype = matmul_dtype(precision)
            peak = matmul_peak(getattr(torch, dtype))
            flops_per_token = training_flops_per_token(cfg.model, cfg.seq_len)
            tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len
            print(f"\n{shape} ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}, "
                  f"context {cfg.seq_len}), {precision}: {tokens_per_step} tokens/step, {dtype} matmul peak "
                  f"{peak / 1e9:.1f} GFLOP/s")
            print(f"{'':20} {'tokens/s':>9} {'s/step':>7} {'of peak':>8} {'max RSS':>8} {'faults/step':>12} {'loader wait':>12}")
            ratios = []
            for name in args.pairs.split(","):
                results = run_pair(PAIRS[name], overrides, args)
                for side, r in results.items():
                    wait = "inline" if r["loader_wait_fraction"] is None else f"{r['loader_wait_fraction']:.2%}"
                    tokens_per_s = tokens_per_step / r["median_step_seconds"]
                    print(f"{side:20} {tokens_per_s:>9,.0f} {r['median_step_seconds']:>7.3f} "
                          f"{tokens_per_s * flops_per_token / peak:>8.1%} {r['max_rss_bytes'] / 2**20:>6,.0f}MB "
                          f"{r['faults_per_step']:>12,.0f} {wait:>12}", flush=True)
                ours, reference = (results[side]["median_step_seconds"] for side in PAIRS[name])
                ratios.append(f"{name} {reference / ours:.3f}")
            print(f"ratio ours/reference (tokens/s): {', '.join(ratios)}", flush=True)
    print_optimizer_steps(args)


if __name__ == "__main__":
    main()
