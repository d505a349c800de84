"""Tensor, sequence, context and pipeline layouts side by side (issue 23 part 8): per rank, the bytes
of parameters, gradients, optimizer states and saved activations, and the bytes sent per step by
kind (the data-parallel group's collectives, the tensor-parallel group's, the context-parallel
ring), the plan's (accounting/) beside the measured, and measured / planned.

The measurement is the trainer's own: each layout is one `Trainer` per rank under torchrun (real
gloo groups, a small prepared corpus), trained a few steps; its end-of-run table
(train/summary.py's predicted_vs_measured, from train/measurements.py's first-step hooks and the
engines' counted collectives) is gathered from every rank (tests/gather_runs.py's way:
all_gather_object), and rank 0 writes them to a JSON file. Bytes do not depend on the machine's
load, so a run on a busy machine gives the same table. A pipeline's point-to-point sends are
planned and counted (tests/test_tp_pipeline_dist.py compares them) but not shown here.

    nice -n 10 python bench/parallel.py --layouts [--layout tp2,cp2] [--steps 3]
    (or python bench/parallel_layouts.py ...): a table to stdout, bench/parallel_layouts.png

The same code runs on GPUs (nccl): the trainer picks the backend from train.device.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_bubble import make_corpus  # noqa: E402

# name -> (ranks, overrides of the tiny model); 4 ranks where two kinds of parallelism combine
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2xddp2": (4, ["parallel.tp=2", "train.parallel=ddp"]),
    "tp2xzero3": (4, ["parallel.tp=2", "train.parallel=zero3"]),
    "cp2": (2, ["parallel.cp=2", "train.parallel=ddp"]),
    "tp2xcp2": (4, ["parallel.tp=2", "parallel.cp=2", "train.parallel=ddp"]),
    "pp2xtp2": (4, ["parallel.pp=2", "train.micro_batches=2", "parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2", "train.micro_batches=2"]),
}
# the rows of the trainer's table this bench shows (a pipeline's are per stage: "stage S <key>")
MEMORY = ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes", "activations_bytes")
SENT = {"dp": "sent_bytes_per_step", "tp": "tp_sent_bytes_per_step", "cp": "cp_sent_bytes_per_step"}
TIMEOUT = 900  # seconds a layout's torchrun may take before the bench stops (a hung rank)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", action="store_true", help="(bench/parallel.py's switch to this bench)")
    parser.add_argument("--layout", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).with_name("parallel_layouts.png")))
    parser.add_argument("--json", default="", help="also write every rank's table there")
    parser.add_argument("--from-json", default="", help="no runs: the table and plot of a --json file")
    parser.add_argument("--rank-main", nargs=2, metavar=("RESULT", "OVERRIDES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.layout = [name.strip() for name in args.layout.split(",") if name.strip()]
    unknown = [name for name in args.layout if name not in LAYOUTS]
    if unknown or not args.layout:
        parser.error(f"--layout: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(LAYOUTS)}")
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1")
    return args


def rank_main(result: str, overrides: list[str]) -> None:
    """One rank: the trainer's run, its predicted-vs-measured table gathered on rank 0."""
    import torch.distributed as dist

    from lmforge.config import make_config
    from lmforge.train.loop import Trainer

    cfg = make_config("tiny", overrides=overrides)
    trainer = Trainer(cfg, Path(result).with_suffix(""), progress=False)  # joins the process group
    table = trainer.run()["predicted_vs_measured"]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, table)
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps(every))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, common: list[str], folder: Path) -> list[dict]:
    ranks, overrides = LAYOUTS[name]
    result = folder / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", __file__, "--rank-main", str(result),
               json.dumps([*common, *overrides])]
    subprocess.run(command, check=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def stages_of(table: dict) -> list[int]:
    """A pipeline's stages, whose rows the trainer's table has apart ("stage S <key>"); [] otherwise."""
    return sorted({int(key.split()[1]) for key in table if key.startswith("stage ")})


def rows_of(table: dict, stage: int | None = None) -> dict[str, tuple[float, float | None]]:
    """{row: (planned, measured)} of one rank's table (of `stage`'s rows in a pipeline's): the
    memory rows and the bytes sent by kind."""
    prefix = f"stage {stage} " if stage is not None else ""
    rows = {key.removesuffix("_bytes"): (table[prefix + key]["predicted"], table[prefix + key]["measured"])
            for key in MEMORY if prefix + key in table}
    for kind, key in SENT.items():
        if key in table:
            rows[f"sent {kind}"] = (table[key]["predicted"], table[key]["measured"])
    return rows


def format_table(results: dict[str, list[dict]]) -> str:
    """A row per rank (a pipeline's: per stage, as the trainer measures it: on replica 0's tensor rank 0)."""
    columns = ("parameters", "gradients", "optimizer_states", "activations", "sent dp", "sent tp", "sent cp")
    lines = [f"{'layout':10} {'rank':>5} | " + " | ".join(f"{c:>26}" for c in (
        "params", "grads", "optim", "activations", "sent dp", "sent tp", "sent cp")),
        f"{'':10} {'':>5} | " + " | ".join(f"{'KiB plan/measured ratio':>26}" for _ in columns)]
    for name, ranks in results.items():
        stages = stages_of(ranks[0])
        rows = ([(f"st {s}", rows_of(ranks[0], s)) for s in stages] if stages
                else [(str(rank), rows_of(table)) for rank, table in enumerate(ranks)])
        for label, row in rows:
            lines.append(f"{name:10} {label:>5} | " + " | ".join(cell(*row.get(c, (None, None))) for c in columns))
    if any(stages_of(ranks[0]) for ranks in results.values()):
        lines.append("pp: per stage (the trainer measures replica 0's tensor rank 0 of each); the stages' "
                     "point-to-point sends are planned and counted too (tests/test_tp_pipeline_dist.py), not shown")
    return "\n".join(lines)


def cell(planned: float | None, measured: float | None) -> str:
    if planned is None:
        return f"{'-':>26}"
    if measured is None:
        return f"{planned / 1024:10.1f}/{'not counted':>11}    "
    ratio = f"{measured / planned:5.3f}" if planned else "    -"
    return f"{planned / 1024:9.1f}/{measured / 1024:9.1f} {ratio}"[:26].rjust(26)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Bars per layout (rank 0's): planned (hatched) beside measured for each row, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    columns = ("parameters", "gradients", "optimizer_states", "activations", "sent dp", "sent tp", "sent cp")
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width, labelled, lowest = 0.8 / (2 * len(columns)), set(), float("inf")
    for x, (name, ranks) in enumerate(results.items()):
        rows = rows_of(ranks[0], (stages_of(ranks[0]) or [None])[0])
        for i, column in enumerate(columns):
            planned, measured = rows.get(column, (None, None))
            if not planned:
                continue
            at = x - 0.4 + 2 * i * width
            ax.bar(at, planned / 1024, width, color=f"C{i}", hatch="//", edgecolor="white",
                   label=None if column in labelled else column.replace("_", " "))
            labelled.add(column)
            lowest = min(lowest, planned / 1024)
            if measured is not None:
                ax.bar(at + width, measured / 1024, width, color=f"C{i}")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_yscale("log")
    ax.set_ylim(bottom=lowest / 2)
    ax.set_ylabel("KiB on rank 0 (a pipeline's stage 0); sent: per step")
    ax.set_title("tiny, fp32, gloo: plan (hatched) beside measured (solid), per layout")
    ax.legend(fontsize=8, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rank_main:
        return rank_main(args.rank_main[0], json.loads(args.rank_main[1]))
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run_layouts(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"tiny, fp32, {args.batch_size} x 64 tokens per micro-batch, {args.steps} steps, gloo; per rank: "
          f"planned / measured KiB, measured / planned")
    print(format_table(results))
    plot(results, Path(args.out))


def run_layouts(args) -> dict[str, list[dict]]:
    """Every layout of --layout trained, in a temporary folder: {layout: [each rank's table]}."""
    with tempfile.TemporaryDirectory(prefix="lmforge-layouts-") as tmp:
        folder = Path(tmp)
        common = [f"data.source={make_corpus(folder / 'corpus')}", f"data.dir={folder / 'data'}",
                  f"train.max_steps={args.steps}", f"train.batch_size={args.batch_size}", "optim.warmup_steps=1",
                  "train.eval_interval=0", "train.eval_batches=1", "train.checkpoint_interval=0",
                  "train.sample_tokens=0", "train.device=cpu"]
        from lmforge.config import make_config
        from lmforge.data.prepare import prepare_data
        prepare_data(make_config("tiny", overrides=common), log=lambda _: None, progress=False)  # once, for all
        results = {}
        for name in args.layout:
            results[name] = run_layout(name, common, folder)
            print(f"{name}: done", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
