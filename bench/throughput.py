"""Training throughput of lmforge beside the same model in plain PyTorch, in one run.

    python bench/throughput.py [--steps 30] [--warmup 3] [--repeats 2] [--model small] [key=value ...]

Each side trains the default config (preset `small`, fp32) for the same number of steps on the
same prepared data, in its own subprocess so that peak memory (max RSS) is measured separately:
  ours       lmforge's Transformer, hand-written AdamW, clipping, schedule, prefetching loader
  reference  bench/reference_llama.py (torch.nn layers, nn.RMSNorm, SDPA), torch.optim.AdamW,
             batches drawn in the loop
It prints tokens/s, the fraction of this machine's measured fp32 matmul peak (model FLOPs from
lmforge.accounting), peak memory, the ratio ours/reference and the data loader's waiting time.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_side(side: str, args) -> dict:
    import numpy as np
    import torch

    from lmforge.accounting.flops import training_flops_per_token
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data
    from lmforge.optim.clip import clip_grad_norm
    from lmforge.train.trainer import Trainer

    cfg = make_config(args.model, overrides=args.overrides + ["train.sample_tokens=0"])
    t, m = cfg.train, cfg.model
    tokens_per_step = t.batch_size * t.grad_accum * cfg.seq_len
    total = args.warmup + args.steps
    if side == "ours":
        from rich.console import Console

        cfg.train.max_steps = total
        trainer = Trainer(cfg, Path(args.scratch) / f"ours-{time.time_ns()}", console=Console(quiet=True),
                          progress=False)
        for _ in range(args.warmup):
            trainer.train_step()
        wait_before = trainer.loader.wait_seconds
        started = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        elapsed = time.perf_counter() - started
        wait = trainer.loader.wait_seconds - wait_before
        trainer.loader.close()
        loss = None
    else:
        from reference_llama import ReferenceLlama

        torch.manual_seed(t.seed)
        data = prepare_data(cfg, log=lambda _: None)
        model = ReferenceLlama(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim,
                               m.max_seq_len, m.rope_theta, m.norm_eps)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        other = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                 {"params": other, "weight_decay": 0.0}], lr=cfg.optim.lr,
                                betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
        rng = np.random.default_rng(0)

        def step():
            for _ in range(t.grad_accum):
                starts = rng.integers(0, len(data.train) - cfg.seq_len, size=t.batch_size)
                w = torch.from_numpy(np.stack([data.train[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
                (model(w[:, :-1], w[:, 1:]) / t.grad_accum).backward()
            clip_grad_norm(model.parameters(), cfg.optim.grad_clip)  # same clipping cost on both sides
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        elapsed = time.perf_counter() - started
        wait = 0.0
    tokens_per_s = args.steps * tokens_per_step / elapsed
    return {"side": side, "tokens_per_s": tokens_per_s, "step_seconds": elapsed / args.steps,
            "flops_per_token": training_flops_per_token(m, cfg.seq_len), "data_wait_fraction": wait / elapsed,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating; the best counts")
    parser.add_argument("--model", default="small")
    parser.add_argument("--scratch", default="bench/out")
    parser.add_argument("--side", choices=["ours", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args)))
        return

    import torch

    from lmforge.accounting.hardware import device_name, matmul_peak
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data

    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    prepare_data(make_config(args.model, overrides=args.overrides))  # once, outside the timing
    peak = matmul_peak(torch.float32)
    results = {}
    for repeat in range(args.repeats):  # alternate the order; keep each side's fastest run
        for side in ("ours", "reference") if repeat % 2 == 0 else ("reference", "ours"):
            cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--model", args.model, "--scratch", args.scratch, *args.overrides]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            if side not in results or result["tokens_per_s"] > results[side]["tokens_per_s"]:
                results[side] = result
    print(f"machine: {device_name(torch.device('cpu'))}, torch {torch.__version__}, "
          f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"model: preset {args.model} {' '.join(args.overrides)}, {args.steps} timed steps after {args.warmup} "
          f"warm-up, best of {args.repeats} alternating runs per side")
    print(f"{'':10} {'tokens/s':>10} {'s/step':>8} {'of peak':>8} {'max RSS':>9} {'loader wait':>12}")
    for side, r in results.items():
        print(f"{side:10} {r['tokens_per_s']:>10,.0f} {r['step_seconds']:>8.3f} "
              f"{r['tokens_per_s'] * r['flops_per_token'] / peak:>8.1%} {r['max_rss_bytes'] / 2**20:>7,.0f}MB "
              f"{r['data_wait_fraction']:>12.2%}")
    ratio = results["ours"]["tokens_per_s"] / results["reference"]["tokens_per_s"]
    print(f"ratio ours/reference: {ratio:.3f}")


if __name__ == "__main__":
    main()
