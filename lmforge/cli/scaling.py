"""`lmforge scaling sweep` and `lmforge scaling fit`: train an IsoFLOP grid of models, then fit
Chinchilla's law to their final validation losses (lmforge/accounting/scaling.py)."""

import json
import subprocess
import sys
from pathlib import Path

from lmforge.cli.arguments import COUNT, RAW, add_overrides, describe, number, picture
from lmforge.common.errors import LmforgeError

EXAMPLES = """\
examples:
  lmforge scaling sweep --out runs/scaling --depths 2,3,4,6 --budgets 3e12,1e13,3e13
  lmforge scaling fit runs/scaling --out runs/scaling/fit.json --plot runs/scaling/fit.png
  lmforge scaling fit runs/scaling --check runs/bigger      # a run outside the sweep against the fit
  lmforge plan --model small --tokens 2e8 --scaling runs/scaling/fit.json
"""
EVAL_BATCHES = 50  # the final validation loss over 50 batches (8 x 50 x 128 tokens by default)


def add_scaling(scaling) -> None:
    describe(scaling, __doc__, EXAMPLES)
    actions = scaling.add_subparsers(dest="scaling_command", metavar="ACTION", required=True)
    sweep = actions.add_parser("sweep", help="train every depth at every compute budget (resumable)",
                               epilog=EXAMPLES, formatter_class=RAW)
    sweep.add_argument("--out", required=True, metavar="DIR", help="the folder of the sweep's run folders")
    sweep.add_argument("--depths", default="2,3,4,5,6", help="layers of each model; d_model = 32 x layers, "
                                                             "heads of 32 (default 2,3,4,5,6)")
    sweep.add_argument("--budgets", default="3e12,1e13,3e13", help="compute budgets C = 6 N D in FLOPs")
    sweep.add_argument("--seq-len", type=COUNT, default=128)
    sweep.add_argument("--vocab-size", type=number(int, at_least=257), default=4096,
                       help="the tokenizer's (default 4096, the default model's: its prepared data is shared)")
    sweep.add_argument("--nproc", type=COUNT, help="run each model under torchrun with N processes (ddp)")
    sweep.add_argument("--dry-run", action="store_true", help="print the grid and stop")
    add_overrides(sweep, "train.batch_size=16 optim.lr=1e-3")
    fit = actions.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta to finished runs",
                             epilog=EXAMPLES, formatter_class=RAW)
    fit.add_argument("runs", nargs="+", metavar="RUNS", help="run folders, or folders that hold them")
    fit.add_argument("--out", metavar="FIT.json", help="write the fit here (for lmforge plan --scaling)")
    fit.add_argument("--plot", metavar="PNG", type=picture, help="draw the IsoFLOP curves and the fit")
    fit.add_argument("--grid", choices=("coarse", "paper"), default="coarse",
                     help="L-BFGS starts: coarse (108) or the paper's 4,500 (default coarse)")
    fit.add_argument("--bootstrap", type=number(int, at_least=0), default=100,
                     help="refits on resampled runs (default 100)")
    fit.add_argument("--check", action="append", default=[], metavar="RUN",
                     help="a finished run outside the fit: its loss beside the prediction")
    fit.add_argument("--max-passes", type=number(float, at_least=0), default=1.0, metavar="P",
                     help="leave out runs that read their training split more than P times (default 1: "
                          "Chinchilla's runs all see their data once)")


def cmd_scaling(args) -> int:
    return (sweep if args.scaling_command == "sweep" else fit)(args)


def _numbers(text: str, option: str, kind=float) -> list:
    """The comma-separated numbers of `option`; an int list takes whole numbers only (2.5 is refused,
    never cut to 2)."""
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise LmforgeError(f"{option} {text}: give comma-separated {what}") from None
    if not values or any(not v > 0 or v == float("inf") for v in values):
        raise LmforgeError(f"{option} {text}: every value must be a positive finite number")
    return values


def sweep(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from lmforge.accounting.scaling import sweep_grid, sweep_model
    from lmforge.config import make_config
    from lmforge.runs.listing import is_run, read_run

    console = Console()
    depths, budgets = _numbers(args.depths, "--depths", int), _numbers(args.budgets, "--budgets")
    train = make_config("tiny", overrides=list(args.overrides)).train  # the user's batch settings, checked
    tokens_per_step = train.batch_size * train.grad_accum * args.seq_len * (args.nproc or 1)
    runs, left_out = sweep_grid(depths, budgets, args.vocab_size, args.seq_len, tokens_per_step)
    console.print(f"IsoFLOP sweep: {len(runs)} runs; d_model = 32 x layers, heads of 32, vocabulary {args.vocab_size}, "
                  f"{tokens_per_step:,} tokens per step; N counts matmul weights, D = C / 6N")
    for run in runs:
        console.print(f"  {run.name}: N {run.parameters:,}, {run.steps:,} steps, {run.tokens:,} tokens")
    for run in left_out:
        console.print(f"  {run.name}: left out ({run.steps} steps < 50: a larger budget or a smaller model)")
    if args.dry_run or not runs:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["--nproc", str(args.nproc), "train.parallel=ddp"] if args.nproc else []
    with Progress(console=console) as progress:
        task = progress.add_task("sweep", total=len(runs))
        for run in runs:
            folder = out / run.name
            if is_run(folder) and read_run(folder).status == "finished":
                progress.advance(task)
                continue
            if is_run(folder):
                command = ["train", "--resume", str(folder), "--no-progress", *launcher[:2]]
            else:
                model = [f"model.{k}={v}" for k, v in sweep_model(run.depth, args.vocab_size, args.seq_len).items()]
                schedule = [f"train.max_steps={run.steps}", f"optim.warmup_steps={max(run.steps // 20, 1)}",
                            "train.eval_interval=0", f"train.eval_batches={EVAL_BATCHES}",
                            f"train.checkpoint_interval={max(run.steps // 4, 1)}", "train.sample_tokens=0"]
                command = ["train", "--out", str(folder), "--no-progress", *launcher, *model, *schedule,
                           *args.overrides]
            progress.update(task, description=f"{run.name} ({run.steps:,} steps)")
            log = out / f"{run.name}.log"
            with open(log, "w") as handle:
                status = subprocess.run([sys.executable, "-m", "lmforge", *command], stdout=handle,
                                        stderr=subprocess.STDOUT).returncode
            if status != 0:
                tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise LmforgeError(f"run {run.name} stopped with status {status} ({tail[0][:200]}); its log is "
                                   f"{log}; run the same sweep command again to continue")
            progress.advance(task)
            console.print(f"{run.name}: val loss {read_run(folder).val_loss:.4f}")
    console.print(f"fit it: lmforge scaling fit {out} --out {out / 'fit.json'} --plot {out / 'fit.png'}")
    return 0


def fit(args) -> int:
    from rich.console import Console

    from lmforge.accounting import scaling
    from lmforge.accounting.scaling import plot_scaling

    console = Console()
    points, repeated = [], []
    for point in (point for folder in args.runs for point in scaling_points(folder)):
        (repeated if point["passes"] is not None and point["passes"] > args.max_passes else points).append(point)
    for p in repeated:
        console.print(f"  {p['name']}: left out ({p['passes']:.2f} passes over its training split > "
                      f"--max-passes {args.max_passes:g}: the law's D is tokens seen once)")
    if len(points) < 5:
        raise LmforgeError(f"{len(points)} finished runs with a validation loss in {' '.join(args.runs)}: a fit "
                           f"of 5 constants needs at least 5 (lmforge scaling sweep makes them)")
    n, d, loss = ([p[key] for p in points] for key in ("parameters", "tokens", "val_loss"))
    grid = scaling.PAPER_GRID if args.grid == "paper" else scaling.COARSE_GRID
    result = scaling.fit_parametric(n, d, loss, grid)
    intervals = scaling.bootstrap(n, d, loss, result, samples=args.bootstrap) if args.bootstrap else {}
    runs = [(6 * p["parameters"] * p["tokens"], p["parameters"], p["val_loss"]) for p in points]
    budgets = [(p["flops"], p["parameters"], p["val_loss"]) for p in points if p.get("flops")]
    minima = scaling.isoflop_minima(budgets)
    report = {"fit": result.as_dict(), "intervals_5_95": intervals, "counting": scaling.COUNTING,
              "isoflop_minima": [m.__dict__ for m in minima], "runs": points,
              "max_passes": args.max_passes, "left_out_repeated": repeated}
    if len(minima) >= 2:
        report["isoflop_exponent"], _ = scaling.power_law([m.flops for m in minima], [m.n_opt for m in minima])
    console.print(f"L(N, D) = {result.E:.4f} + {result.A:.4g} / N^{result.alpha:.4f} "
                  f"+ {result.B:.4g} / D^{result.beta:.4f}  ({len(points)} runs, "
                  f"Huber objective {result.objective:.3g})")
    for key, (lo, hi) in intervals.items():
        console.print(f"  {key}: {getattr(result, key):.4g}  "
                      f"(5-95%: {lo:.4g} .. {hi:.4g}, {args.bootstrap} bootstraps)")
    a = result.beta / (result.alpha + result.beta)
    isoflop = (f", C^{report['isoflop_exponent']:.3f} (IsoFLOP minima of {len(minima)} budgets)"
               if "isoflop_exponent" in report else "")
    console.print(f"compute-optimal N ~ C^{a:.3f} (parametric)" + isoflop)
    for m in minima:
        console.print(f"  C = {m.flops:.1e}: best N {m.n_opt:,.0f} (IsoFLOP parabola), "
                      f"{result.compute_optimal(m.flops)[0]:,.0f} (fit)")
    for folder in args.check:
        for p in scaling_points(folder):
            predicted = result.loss(p["parameters"], p["tokens"])
            passes = "" if p["passes"] is None else f" ({p['passes']:.2f} passes)"
            console.print(f"check {p['name']}: N {p['parameters']:,}, D {p['tokens']:,}{passes}: measured "
                          f"{p['val_loss']:.4f}, predicted {predicted:.4f} "
                          f"({(predicted - p['val_loss']) / p['val_loss']:+.2%})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"fit: {args.out} (lmforge plan --scaling {args.out})")
    if args.plot:
        plot_scaling(runs if not budgets else budgets, result, minima, args.plot)
        console.print(f"figure: {args.plot}")
    return 0


def scaling_points(folder: str) -> list[dict]:
    """One point per finished run in `folder` (or `folder` itself): its N (matmul weights), D (tokens
    trained), passes over its training split (None when its prepared data is not found), final
    validation loss and, for a sweep run, its budget C."""
    from lmforge.accounting.shapes import model_shapes
    from lmforge.data.prepare import data_dir_of
    from lmforge.runs.listing import find_runs, read_summary

    points = []
    for run in find_runs(folder):
        summary = read_summary(run.path, cut_off_ok=False)  # a damaged one is named, never left out quietly
        if run.status != "finished" or summary is None or summary.get("val_loss") is None:
            continue
        if summary.get("tokens_trained") is None:
            raise LmforgeError(f"{run.path / 'summary.json'} has no tokens_trained (expected an integer)")
        name = run.path.name
        flops = _budget(name)
        split = _train_tokens(data_dir_of(run.cfg) / "meta.json")
        points.append({"name": name, "parameters": model_shapes(run.cfg.model).matmul_weights,
                       "tokens": summary["tokens_trained"], "val_loss": summary["val_loss"], "flops": flops,
                       "passes": summary["tokens_trained"] / split if split else None})
    return points


def _budget(name: str) -> float | None:
    """A sweep run's compute budget C, from its name (C3e12-L4), else None."""
    try:
        return float(name[1:name.index("-L")]) if name.startswith("C") and "-L" in name else None
    except ValueError:
        return None


def _train_tokens(meta: Path) -> int | None:
    """The tokens of a prepared training split (meta.json), None if it is not found."""
    if not meta.is_file():
        return None
    try:
        tokens = json.loads(meta.read_bytes())["splits"]["train"]["tokens"]
    except (ValueError, KeyError, TypeError):
        raise LmforgeError(f"{meta}: expected the prepared data's splits.train.tokens (lmforge prepare writes it); "
                           f"prepare the data again") from None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise LmforgeError(f"{meta}: splits.train.tokens is {tokens!r}, expected a positive integer")
    return tokens
