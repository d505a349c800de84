"""What each precision policy costs and risks: the same model, seed, data and steps under each.

    python bench/precision.py [--steps 150] [--model small] [--policies fp32,bf16-mixed,...] [key=value ...]

Each policy trains `lmforge train`'s Trainer from the same seed on the same batches of the
embedded corpus, then the script prints, per policy: final train and validation loss, the ratio of
the validation loss to fp32's, tokens/s relative to fp32, and the measured bytes of parameters plus
optimizer state relative to fp32; and it writes the loss curves overlaid (bench/out/precision_loss.png;
`--update-docs` replaces bench/precision_loss.png, the figure the README shows).

The model is a reduced `small` (d_model 128, 4 layers, context 128; the defaults below) because
fp16 has no hardware matmul on CPUs: PyTorch emulates each fp16 matmul, tens of times slower than
fp32 (the matmul table printed first measures it on this machine), so the full model under
fp16-mixed would take hours. On a GPU the same script measures the real speed of every policy.
fp8 runs simulated on CPU (lmforge/precision/fp8.py: the same numbers as `torch._scaled_mm`, at
about bf16 speed for the forward, fp32 for the weight gradient), so its tokens/s here say nothing
about fp8 hardware.

Each policy runs once, in this process, one after the other, with torch's default threads. On a
machine shared with other jobs pass `--threads 1`: two OpenMP threads on two busy cores stall in
barriers (steps 20x slower at random moments), one thread does not. tokens/s carry the machine's
noise (the losses do not: training is deterministic here). tokens/s is the
median over windows of 5 steps, the first window (kernel set-up) left out.
"""

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Results go to bench/out/ (untracked); DOCS_PNG is the committed figure, replaced with --update-docs.
OUT = Path(__file__).resolve().parent / "out"
DOCS_PNG = Path(__file__).resolve().parent / "precision_loss.png"
POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp8")
COLORS = dict(zip(POLICIES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
REDUCED = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
           "model.max_seq_len=128", "train.batch_size=8", "optim.warmup_steps=10"]


def matmul_seconds(dtype: torch.dtype, n: int = 512, repeats: int = 3) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return best


def fp8_scaled_mm_seconds(n: int = 512, repeats: int = 3) -> float:
    a = torch.randn(n, n).to(torch.float8_e4m3fn)
    b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        best = min(best, time.perf_counter() - started)
    return best


def state_bytes(trainer) -> int:
    """Measured bytes of the parameters (tied ones once) plus every optimizer state tensor."""
    params = dict.fromkeys(trainer.model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    for state in trainer.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--model", default="small")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 on a shared machine, where more stall in "
                             "OpenMP barriers)")
    parser.add_argument("--scratch", default=str(OUT / "precision"))
    parser.add_argument("--png", help="where the loss curves go (default bench/out/precision_loss.png)")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the curves to bench/precision_loss.png, the figure README and RESULTS.md show")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the runs in --scratch")
    parser.add_argument("overrides", nargs="*", help="config overrides after the reduced model's")
    args = parser.parse_args()
    # the tracked figure changes only when asked to
    args.png = args.png or str(DOCS_PNG if args.update_docs else OUT / "precision_loss.png")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return replot(Path(args.scratch), args.png)

    from rich.console import Console

    from lmforge.accounting.hardware import device_name
    from lmforge.config import make_config
    from lmforge.runs.metrics import read_metrics
    from lmforge.train.loop import Trainer

    policies = args.policies.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"machine: {device_name(torch.device(device))} (torch threads), "
          f"torch {torch.__version__}, Python {platform.python_version()}")
    if device == "cpu":
        fp32 = matmul_seconds(torch.float32)
        print("512x512 matmul on this CPU, time relative to fp32 (why fp16 is slow here): "
              + ", ".join(f"{name} {seconds / fp32:.2f}x" for name, seconds in
                          (("bf16", matmul_seconds(torch.bfloat16)), ("fp16", matmul_seconds(torch.float16)),
                           ("fp8 torch._scaled_mm", fp8_scaled_mm_seconds()))))

    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    results = {}
    for policy in policies:
        overrides = [*REDUCED, f"train.max_steps={args.steps}", "train.eval_interval=0", "train.eval_batches=8",
                     f"train.checkpoint_interval={args.steps}", "train.log_interval=5", "train.sample_tokens=0",
                     f"train.device={device}", *args.overrides, f"train.precision={policy}"]
        cfg = make_config(args.model, overrides=overrides)
        started = time.perf_counter()
        trainer = Trainer(cfg, scratch / policy, console=Console(quiet=True), progress=False)
        summary = trainer.run()
        records = read_metrics(scratch / policy / "metrics.jsonl")
        lost = [r["lost_update_fraction"] for r in records if "lost_update_fraction" in r]
        # tokens/s: median over the logged windows of 5 steps, leaving out the first (kernel set-up)
        windows = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
        results[policy] = {
            "train_loss": summary["train_loss"], "val_loss": summary["val_loss"],
            "tokens_per_s": statistics.median(windows) if windows else summary["tokens_per_s"],
            "state_bytes": state_bytes(trainer),
            "skipped_steps": summary["skipped_steps"], "wall_s": time.perf_counter() - started,
            "lost_update_fraction": sum(lost) / len(lost) if lost else None,
            "curve": [(r["step"], r["train_loss"]) for r in records if "train_loss" in r],
        }
        print(f"  {policy}: done in {results[policy]['wall_s']:.0f} s", flush=True)

    m = cfg.model
    print(f"\nmodel: preset {args.model} reduced to d_model {m.d_model}, {m.n_layers} layers, context "
          f"{cfg.seq_len}, vocab {m.vocab_size} ({trainer.model.num_params() / 1e6:.2f}M parameters); "
          f"{args.steps} steps of {trainer.measurements.tokens_per_step:,} tokens, seed {cfg.train.seed}, same batches for all")
    base = results.get("fp32")
    header = (f"{'policy':<11} {'train loss':>10} {'val loss':>9} {'val/fp32':>9} {'tokens/s':>9} {'speed/fp32':>10} "
              f"{'param+opt MB':>12} {'bytes/fp32':>10} {'skipped':>7}  lost updates")
    print(header)
    for policy, r in results.items():
        ratio = lambda key: f"{r[key] / base[key]:.3f}" if base else "-"  # noqa: E731
        lost = f"{r['lost_update_fraction']:.1%}" if r["lost_update_fraction"] is not None else "-"
        print(f"{policy:<11} {r['train_loss']:>10.4f} {r['val_loss']:>9.4f} {ratio('val_loss'):>9} "
              f"{r['tokens_per_s']:>9,.0f} {ratio('tokens_per_s'):>10} {r['state_bytes'] / 1e6:>12.2f} "
              f"{ratio('state_bytes'):>10} {r['skipped_steps']:>7}  {lost}")
    if device == "cpu" and "fp16-mixed" in results:
        print("note: fp16-mixed is slow here because this CPU has no fp16 matmul (see the matmul line above); "
              "fp8 is simulated on CPU, its speed is not that of fp8 hardware")

    (scratch / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.png, f"{trainer.model.num_params() / 1e6:.2f}M-parameter Llama, same seed and batches")
    print(f"loss curves: {args.png}")


def replot(scratch: Path, png: str) -> None:
    from lmforge.runs.metrics import read_metrics

    results = {}
    for policy in POLICIES:
        if (scratch / policy / "summary.json").is_file():
            summary = json.loads((scratch / policy / "summary.json").read_text())
            records = read_metrics(scratch / policy / "metrics.jsonl")
            results[policy] = {"val_loss": summary["val_loss"], "parameters": summary["parameters"],
                               "curve": [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]}
    parameters = next(iter(results.values()))["parameters"]
    plot(results, png, f"{parameters / 1e6:.2f}M-parameter Llama, same seed and batches")
    print(f"loss curves: {png}")


def plot(results: dict, png: str, title: str) -> None:
    """Loss curves overlaid (top) and each policy's difference from fp32 (bottom, where they show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True, height_ratios=(3, 2))
    base = dict(map(tuple, results["fp32"]["curve"])) if "fp32" in results else None
    for policy, r in results.items():
        steps, losses = zip(*r["curve"])
        top.plot(steps, losses, label=f"{policy} (val {r['val_loss']:.3f})", linewidth=1.2, color=COLORS[policy])
        if base is not None:
            bottom.plot(steps, [loss - base[step] for step, loss in r["curve"]], linewidth=1.2, color=COLORS[policy])
    top.set_ylabel("train loss (nats/token,\nmean of 5 steps)")
    top.set_title(f"precision policies: {title}")
    top.legend()
    bottom.set_ylabel("minus fp32's loss")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    main()
