"""Pictures and labels of a run: loss.png (loss, learning rate, tokens/s, and the scores of
train.eval_tasks where the run has them) and the run's title."""

import dataclasses
from pathlib import Path

from lmforge.config import MODEL_PRESETS, Config, ModelConfig
from lmforge.runs.metrics import read_metrics


def model_label(m: ModelConfig) -> str:
    """The preset's name when the shape is one (how attention is computed does not change it), else
    the family and shape: "small" or "llama 8x384"."""
    shape = {**dataclasses.asdict(m), "attention": "sdpa", "dropout": 0.0}
    for name, preset in MODEL_PRESETS.items():
        if dataclasses.asdict(ModelConfig(**preset)) == shape:
            return name
    return f"{m.family} {m.n_layers}x{m.d_model}"


def batch_label(cfg: Config) -> str:
    """Sequences x tokens per micro-batch, and the accumulation: "8x256" or "8x256 x4 accum"."""
    accum = f" x{cfg.train.grad_accum} accum" if cfg.train.grad_accum > 1 else ""
    return f"{cfg.train.batch_size}x{cfg.seq_len}{accum}"


def run_title(name: str, cfg: Config, parameters: int) -> str:
    """Two lines naming a run and the settings that shape its curves."""
    return (f"{name}: {model_label(cfg.model)}, {parameters / 1e6:.2f}M parameters\n"
            f"batch {batch_label(cfg)}, {cfg.train.precision}, lr {cfg.optim.lr:g} "
            f"(warmup {cfg.optim.warmup_steps}), {cfg.train.max_steps} steps")


def plot_losses(metrics_path: Path, png_path: Path, title: str, unigram_entropy: float | None = None,
                tokens_per_step: int | None = None) -> None:
    """Three panels against the step: training and validation loss (with the unigram-entropy
    baseline), learning rate, tokens/s; tokens seen on the top axis when tokens_per_step is given.
    A run with train.eval_tasks has a fourth under the loss: each task's acc_norm at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    records = read_metrics(metrics_path)

    def series(key):
        return list(zip(*[(r["step"], r[key]) for r in records if r.get(key) is not None])) or [(), ()]

    tasks = eval_task_names(records)
    ratios = [3, *([2] if tasks else []), 1.2, 1.2]
    fig, axes = plt.subplots(len(ratios), 1, figsize=(7.5, 7.5 * sum(ratios) / 5.4), dpi=120, sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    ax_loss, ax_lr, ax_speed = axes[0], axes[-2], axes[-1]
    ax_loss.plot(*series("train_loss"), label="train", color="tab:blue", linewidth=1.2)
    ax_loss.plot(*series("val_loss"), "o-", label="validation", color="tab:orange", markersize=4)
    if unigram_entropy is not None:
        ax_loss.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1,
                        label=f"unigram entropy ({unigram_entropy:.2f})")
    ax_loss.set_ylabel("cross-entropy\n(nats/token)")
    ax_loss.legend()
    if tokens_per_step:
        tokens = ax_loss.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step,
                                                           lambda n: n / tokens_per_step))
        tokens.set_xlabel("tokens seen")
        tokens.xaxis.set_major_formatter(EngFormatter())
    if tasks:
        for task in tasks:
            axes[1].plot(*series(f"eval/{task}/acc_norm"), "o-", label=task, markersize=3, linewidth=1)
        axes[1].set_ylabel("acc_norm\n(train.eval_tasks)")
        axes[1].legend(fontsize=7)
    ax_lr.plot(*series("lr"), color="tab:green", linewidth=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_speed.plot(*series("tokens_per_s"), color="tab:purple", linewidth=1.2)
    ax_speed.set_ylabel("tokens/s")
    ax_speed.yaxis.set_major_formatter(EngFormatter())
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def eval_task_names(records: list[dict]) -> list[str]:
    """The tasks of train.eval_tasks a run's metrics records hold (fields eval/TASK/...), in order."""
    names = {key.split("/")[1]: None for r in records for key in r if key.startswith("eval/")}
    return [name for name in names if name != "aggregate"]
