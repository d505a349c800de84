"""The pipeline bubble measured against the formula (p-1)/(m+p-1), (p-1)/(vm+p-1) interleaved
(issue 12's and issue 26's evidence).

For each number of stages p and micro-batches m (and each schedule), trains a small model a few
steps with the real command, `python -m lmforge train --nproc p parallel.pp=p
train.micro_batches=m train.schedule=S ...`, in a temporary run folder, and reads the measured
bubble the trainer writes into the run's summary.json under "pipeline" (from the timeline of its
ranks: lmforge/parallel/timeline.py). Prints a table (p, m, formula, measured, ratio), writes
the measured points beside the formula's curves to --out, and keeps the run's pipeline.png of one
(p, m) per schedule next to it (--timeline).

    nice -n 10 python bench/pipeline_bubble.py [--stages 2,4] [--micro-batches 1,2,4,8,16]
        [--schedule 1f1b,gpipe,interleaved-1f1b] [--virtual-stages 2] [--steps 4]
        [--model-args "model.n_layers=8 ..."] [--out bench/pipeline_bubble.png]

interleaved-1f1b runs with train.pipeline_virtual_stages=V (--virtual-stages) and only where m is
a multiple of p (its rounds of p micro-batches); the others are skipped.

The data is a small corpus (the first ~600 KB of this Python's standard library), prepared once
in the temporary folder. The model is untied (model.tie_embeddings=false), so that the bubble
does not depend on how the tied embedding's gradient is shared between the first and last stage.

On a 2-core CPU, p=4 ranks share 2 cores: compute that should overlap across stages is
time-sliced, so a stage that waits in the bubble lends its core to the others and the measured
bubble at p=4 is not the GPU figure (each rank there has its own device). The timeline picture is
still right about the schedule's shape: which stage computes which micro-batch, in what order.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

DEFAULT_MODEL_ARGS = ("model.n_layers=8 model.d_model=128 model.n_heads=4 model.n_kv_heads=2 "
                      "model.tie_embeddings=false train.batch_size=4 train.seq_len=64")
TIMEOUT = 900  # seconds one run may take before the bench stops (a hung rank)


def int_list(text: str) -> list[int]:
    return [int(word) for word in text.split(",") if word.strip()]


def make_corpus(folder: Path, limit: int = 600_000) -> Path:
    """The first modules of this interpreter's standard library, about `limit` characters: enough
    text for a 512-token vocabulary, prepared in seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        (folder / path.name).write_text(text, encoding="utf-8")
        total += len(text)
        if total > limit:
            break
    return folder


def common_args(corpus: Path, data_dir: Path, model_args: list[str], steps: int) -> list[str]:
    """The preset and overrides every run shares: the model, the data, few steps, a tiny evaluation
    at the end only, no sample, a checkpoint only at the end."""
    return ["--model", "tiny", f"data.source={corpus}", f"data.dir={data_dir}", *model_args,
            f"train.max_steps={steps}", "optim.warmup_steps=1", "train.eval_interval=0", "train.eval_batches=1",
            "train.checkpoint_interval=0", "train.log_interval=1", "train.sample_tokens=0"]


def train_command(stages: int, micro_batches: int, schedule: str, run_dir: Path, common: list[str],
                  virtual_stages: int = 1) -> list[str]:
    chunks = [f"train.pipeline_virtual_stages={virtual_stages}"] if schedule == "interleaved-1f1b" else []
    return [sys.executable, "-m", "lmforge", "train", "--nproc", str(stages), "--out", str(run_dir), "--no-progress",
            *common, f"parallel.pp={stages}", f"train.micro_batches={micro_batches}",
            f"train.schedule={schedule}", *chunks]


def read_result(run_dir: Path) -> dict:
    """The "pipeline" record of the run's summary.json."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the run did not finish")
    summary = json.loads(path.read_text())
    if "pipeline" not in summary:
        raise SystemExit(f"{path} has no \"pipeline\" record: was the run a pipeline (parallel.pp > 1)?")
    return summary["pipeline"]


def format_table(results: list[dict]) -> str:
    """A Markdown table, one row per run: schedule, p, v (chunks per stage), m, formula, measured,
    measured / formula, and each stage's idle share."""
    lines = ["| schedule | p | v | m | formula (p-1)/(vm+p-1) | measured | measured / formula | idle per stage |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        formula, measured = r["bubble_formula"], r["bubble_measured"]
        ratio = f"{measured / formula:.2f}" if formula > 0 else "-"  # p = 1 has no bubble to compare with
        idle = " ".join(f"{x:.3f}" for x in r["idle_fraction_per_stage"])
        lines.append(f"| {r['schedule']} | {r['stages']} | {r.get('virtual_stages', 1)} | {r['micro_batches']} | "
                     f"{formula:.3f} | {measured:.3f} | "
                     f"{ratio} | {idle} |")
    return "\n".join(lines)


def plot_bubbles(results: list[dict], path: Path, title: str) -> None:
    """The measured bubble against m (log 2 axis): the formula's curve and the measured points,
    one colour per p, one marker per schedule (filled: 1f1b, open: gpipe); interleaved runs add
    their own formula's curve, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    stages = sorted({r["stages"] for r in results})
    schedules = sorted({r["schedule"] for r in results})
    markers = dict(zip(schedules, "osD^v"))
    largest = max(r["micro_batches"] for r in results)
    curve_m = [1 + i * (largest - 1) / 200 for i in range(201)]
    # the schedules' points side by side at each m (a small shift on the log axis), not on top of each other
    shift = {schedule: 2 ** (0.06 * (i - (len(schedules) - 1) / 2)) for i, schedule in enumerate(schedules)}
    for i, p in enumerate(stages):
        colour = f"C{i}"
        ax.plot(curve_m, [(p - 1) / (m + p - 1) for m in curve_m], color=colour, linewidth=1.2,
                label=f"p={p}: formula (p-1)/(m+p-1)")
        for v in sorted({r.get("virtual_stages", 1) for r in results if r["stages"] == p} - {1}):
            ax.plot(curve_m, [(p - 1) / (v * m + p - 1) for m in curve_m], color=colour, linewidth=1.2,
                    linestyle="--", label=f"p={p}: formula (p-1)/(vm+p-1), v={v}")
        for schedule in schedules:
            points = sorted((r["micro_batches"] * shift[schedule], r["bubble_measured"]) for r in results
                            if r["stages"] == p and r["schedule"] == schedule)
            if points:
                ax.plot(*zip(*points), linestyle="none", marker=markers[schedule], color=colour, markersize=6,
                        markerfacecolor="none" if schedule == "gpipe" else colour,
                        label=f"p={p}: measured, {schedule}")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["micro_batches"] for r in results})
    ax.set_xticks(ticks, [str(m) for m in ticks])
    ax.set_xlabel("micro-batches per step m")
    ax.set_ylabel("bubble: idle share of the step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int_list, default=[2, 4], help="comma-separated p (default 2,4)")
    parser.add_argument("--micro-batches", type=int_list, default=[1, 2, 4, 8, 16],
                        help="comma-separated m (default 1,2,4,8,16)")
    parser.add_argument("--schedule", default="1f1b,gpipe", help="comma-separated schedules (default 1f1b,gpipe)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per stage of interleaved-1f1b runs (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    parser.add_argument("--model-args", default=DEFAULT_MODEL_ARGS,
                        help=f"overrides after --model tiny (default: {DEFAULT_MODEL_ARGS!r})")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("pipeline_bubble.png"),
                        help="the plot (default bench/pipeline_bubble.png)")
    parser.add_argument("--timeline", default="4,8",
                        help="P,M whose pipeline.png is kept beside --out for each schedule (\"\": none)")
    args = parser.parse_args()
    schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
    keep = tuple(int_list(args.timeline)) if args.timeline else None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    with tempfile.TemporaryDirectory(prefix="lmforge-bubble-") as tmp:
        common = common_args(make_corpus(Path(tmp) / "corpus"), Path(tmp) / "data",
                             shlex.split(args.model_args), args.steps)
        # prepare the data once, so that the runs below only read it
        subprocess.run([sys.executable, "-m", "lmforge", "prepare", *common], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        for schedule in schedules:
            for p in args.stages:
                for m in args.micro_batches:
                    if schedule == "interleaved-1f1b" and m % p:
                        print(f"{schedule}, p={p}, m={m}: skipped (m not a multiple of p)", file=sys.stderr)
                        continue
                    run_dir = Path(tmp) / f"{schedule}-p{p}-m{m}"
                    print(f"{schedule}, p={p}, m={m} ...", file=sys.stderr, flush=True)
                    done = subprocess.run(train_command(p, m, schedule, run_dir, common, args.virtual_stages),
                                          env=env, timeout=TIMEOUT, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"{schedule} p={p} m={m} failed (exit {done.returncode}):\n"
                                         f"{done.stderr[-3000:]}")
                    results.append(read_result(run_dir))
                    if keep == (p, m):
                        copy = args.out.with_name(f"pipeline_timeline_{schedule}_p{p}_m{m}.png")
                        copy.write_bytes((run_dir / "pipeline.png").read_bytes())
                        print(f"kept {copy}", file=sys.stderr)
    print(format_table(results))
    plot_bubbles(results, args.out, f"pipeline bubble, measured vs formula ({args.steps} steps per run; "
                                    f"{os.cpu_count()} CPU cores)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
