"""What each initialisation scheme (model.init, model.zero_init_proj; lmforge/model/init.py) does at
step 0 and after a few steps, on the embedded corpus.

    python bench/init_stats.py [--model tiny] [--steps 50] [--threads 1] [key=value ...]

For each scheme, `lmforge train`'s Trainer builds the model from the same seed; before any step,
one forward and backward on the same real validation batch records, per block, the standard
deviation of the block's output (the residual stream) and of the loss gradient with respect to it
(the back-propagated gradient Glorot & Bengio 2010 plot in their figures 6-7). Then the run trains
`--steps` steps on the same batches (same seed, same data order). Printed: the step-0 loss, the
per-layer stds and the final train and validation losses; plotted: the two std profiles and the
loss curves (bench/init_stats.png). Only losses and stds are reported: they are deterministic
here, whereas timings on a shared machine are not.
"""

import argparse
import platform
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HERE = Path(__file__).resolve().parent
# name: the overrides that pick the scheme (zero_proj: today's scheme with zeroed o_proj and down_proj)
SCHEMES = {"scaled_normal": ["model.init=scaled_normal"], "xavier": ["model.init=xavier"],
           "kaiming": ["model.init=kaiming"], "zero_proj": ["model.init=scaled_normal", "model.zero_init_proj=true"]}


def step0_stats(model, inputs, targets) -> dict:
    """The loss and, per block, std of its output and of d loss / d output, one forward/backward."""
    outputs = []

    def keep(module, args, out):  # returns None: the output goes on unchanged
        out.retain_grad()
        outputs.append(out)

    hooks = [block.register_forward_hook(keep) for block in model.blocks.values()]
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets)
    loss.backward()
    for hook in hooks:
        hook.remove()
    stats = {"loss": loss.item(), "activation_std": [o.detach().std().item() for o in outputs],
             "gradient_std": [o.grad.std().item() for o in outputs]}
    model.zero_grad(set_to_none=True)
    return stats


def run_scheme(name: str, args, scratch: Path) -> dict:
    from rich.console import Console

    from lmforge.config import make_config
    from lmforge.data.loader import window_batch
    from lmforge.runs.metrics import read_metrics
    from lmforge.train.loop import Trainer

    overrides = [f"train.max_steps={args.steps}", f"optim.warmup_steps={max(args.steps // 10, 1)}", "train.eval_interval=0", "train.eval_batches=8",
                 f"train.checkpoint_interval={args.steps}", "train.log_interval=1", "train.sample_tokens=0",
                 "train.device=cpu", *args.overrides, *SCHEMES[name]]
    cfg = make_config(args.model, overrides=overrides)
    trainer = Trainer(cfg, scratch / name, console=Console(quiet=True), progress=False)
    inputs, targets = window_batch(trainer.data.val, cfg.train.batch_size, cfg.seq_len, seed=0, index=0)
    stats = step0_stats(trainer.model, inputs, targets)
    summary = trainer.run()
    records = read_metrics(scratch / name / "metrics.jsonl")
    stats.update(train_loss=summary["train_loss"], val_loss=summary["val_loss"],
                 curve=[(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None])
    return stats, cfg


def plot(results: dict, png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in results.items():
        layers = range(len(r["activation_std"]))
        axes[0].plot(layers, r["activation_std"], marker="o", label=name)
        axes[1].plot(layers, r["gradient_std"], marker="o", label=name)
        steps, losses = zip(*r["curve"])
        axes[2].plot(steps, losses, label=name)
    axes[0].set(title="step 0: std of each block's output", xlabel="block", ylabel="std")
    axes[1].set(title="step 0: std of d loss / d block output", xlabel="block", ylabel="std", yscale="log")
    axes[2].set(title="train loss", xlabel="step", ylabel="nats/token")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--scratch", default=str(HERE / "out" / "init_stats"))
    parser.add_argument("--png", default=str(HERE / "init_stats.png"))
    parser.add_argument("overrides", nargs="*", help="key=value settings for every scheme")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lmforge.accounting.hardware import device_name

    print(f"machine: {device_name(torch.device('cpu'))}, torch {torch.__version__}, Python {platform.python_version()}")
    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    results = {}
    for name in SCHEMES:
        results[name], cfg = run_scheme(name, args, scratch)
    m = cfg.model
    print(f"model: preset {args.model} (d_model {m.d_model}, {m.n_layers} layers, vocab {m.vocab_size}, "
          f"tied {m.tie_embeddings}); {args.steps} steps, seed {cfg.train.seed}, the same batches for every scheme")
    print(f"{'scheme':<14} {'loss@0':>7} {'act std per block':>24} {'grad std per block':>28} "
          f"{'train':>7} {'val':>7}")
    for name, r in results.items():
        act = " ".join(f"{v:.3f}" for v in r["activation_std"])
        grad = " ".join(f"{v:.2e}" for v in r["gradient_std"])
        print(f"{name:<14} {r['loss']:>7.4f} {act:>24} {grad:>28} {r['train_loss']:>7.4f} {r['val_loss']:>7.4f}")
    plot(results, Path(args.png), f"initialisation schemes: preset {args.model}, {args.steps} steps, same seed and data")
    print(f"figure: {args.png}")


if __name__ == "__main__":
    main()
