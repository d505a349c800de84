"""Time to a target validation loss (issue 27 part 5): the baseline recipe against candidates.

    python bench/speedrun.py [--recipes best] [--seeds 3] [--model small] [--target 3.86]
                             [--ablation [added|removed]] [--max-steps 1000] [--dry-run] [section.key=value ...]

Each recipe is a list of techniques, each technique a list of `lmforge train` overrides (TECHNIQUES
below): adding one is a line. Every run is its own `python -m lmforge train` process, in its own run
folder under --out, on the same prepared data (prepared once first), evaluated every EVAL_TOKENS
training tokens (a number of steps that depends on the recipe's batch) on EVAL_BATCHES fixed
validation batches, and stopped by `train.target_loss` at the first
evaluation at or below the target (checkpoint and summary written; lmforge/train/loop.py).

Per seed the baseline runs first, then each candidate, so that neighbours see the same machine load;
the ratio candidate/baseline is taken within a seed, and over seeds as a geometric mean. Time to
target is the run's training time: its steps and its compile, without evaluation and checkpoints
(summary.json's train_seconds_this_session + compile_seconds; the speedrun convention of
modded-nanogpt, where evaluation is not counted); the process's whole wall time is reported beside.
The target is resolved to one evaluation: a run reaches it at a multiple of its evaluation interval.

`--jobs N` runs N training processes at once, each on cpu_count / N threads: for exploring and for
ablations, where what is compared is the tokens to the target (they do not depend on the machine's
load); the times of runs that shared the machine are not compared (the report says so).

`--ablation`: for the first candidate, each of its techniques added alone to the baseline and
removed alone from it (`--ablation removed` or `added`: only those rows). The plot (validation loss against training time) is written to --png and
the results to the JSON file beside it.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.data.prepare import data_dir_of  # noqa: E402

HERE = Path(__file__).resolve().parent
# `lmforge train`'s default run (`small`, 900 steps) ends at 3.86 nats/token (README; bench/RESULTS.md:
# 3.8584 fp32, 3.8574 bf16-mixed, on the 8 default evaluation batches)
TARGETS = {"small": 3.86}
# Every run evaluates the same validation batches, whatever its train.seed and batch size: those the target
# was measured on (the default run's, train.seed 1337 + 1, 8 batches of 8 x 256 = 16,384 tokens; a recipe
# of batch 16 draws those 8 windows and 8 more per batch unless train.eval_batch_size=8: until 2026-12-07
# they did, see bench/RESULTS.md, "Validation windows of a batch-16 recipe"). Fixed batches give
# each model one deterministic estimate; the per-batch spread (0.30 nats at loss 5.6, `small`) puts the
# 8-batch mean within about 0.1 nats of the whole split's loss, an offset shared by every run compared.
# Evaluated every 40,960 training tokens (20 steps of the baseline's 8 x 256): a recipe with a larger
# batch is evaluated at the same token counts, so that its tokens to target are resolved as finely.
EVAL_TOKENS, EVAL_SEED, EVAL_BATCHES, EVAL_ROWS = 40_960, 1338, 8, 8
FIRST_SEED = 1337  # seed 1 trains with train.seed 1337: the default run itself; seed k with 1336 + k
# The baseline: today's default recipe at its fastest existing settings; its cosine keeps its 900-step
# length even when --max-steps lets a run go on past it (at the floor learning rate) to reach the target.
BASELINE = ["train.precision=bf16-mixed", "optim.decay_steps=900"]
MEASURE = ["train.checkpoint_interval=0", "train.sample_tokens=0", "train.tensorboard=false",
           f"train.eval_seed={EVAL_SEED}", f"train.eval_batches={EVAL_BATCHES}", f"train.eval_batch_size={EVAL_ROWS}"]
TECHNIQUES = {  # the literature's small-scale speedups (modded-nanogpt, nanochat; docs/recipe.md)
    "compile": ["train.compile=true"],
    "wsd": ["optim.schedule=wsd", "optim.decay_fraction=0.3"],  # Hägele et al. 2024
    "zero_init": ["model.zero_init_proj=true"],
    "relu2": ["model.mlp=relu2"],
    "qk_norm": ["model.qk_norm=true"],
    "untied": ["model.tie_embeddings=false"],
    "softcap": ["model.logit_softcap=30"],
    "lr2x": ["optim.lr=6e-3"],
    "short": ["optim.decay_steps=600"],  # a shorter schedule: the decay that finishes the loss comes sooner
    "batch16": ["train.batch_size=16", "optim.decay_steps=450"],  # twice the tokens per step, half the steps
    "seq128": ["train.seq_len=128", "train.batch_size=16"],  # the same tokens per step in shorter windows
    "muon": ["optim.name=muon"],  # Jordan et al. 2024 (issue 27 part 1)
    # Muon's Newton-Schulz costs the same per step whatever the batch: twice the batch halves it per token
    # (at 8 x 256 it is ~40% of a step's FLOPs on `small`); the schedule is then counted in steps of 16
    "b16": ["train.batch_size=16", "optim.warmup_steps=25"],
    "sched240": ["optim.decay_steps=240"],  # at batch 16: 983k tokens (the 8 x 256 schedule of 480 steps)
    "lr_hi": ["optim.lr=6e-3", "optim.muon_lr=0.04"],  # twice AdamW's and Muon's peaks
    # higher peaks still (exploration, seed 1: Muon 0.06 and AdamW 1e-2 over 220 steps reach the target
    # 20 steps before `speedrun`; bench/RESULTS.md)
    "lr_hi2": ["optim.lr=1e-2", "optim.muon_lr=0.06"],
    "sched220": ["optim.decay_steps=220"],
    # fewer Newton-Schulz iterations: its cost per step falls by a fifth each (optim/muon.py)
    "ns4": ["optim.muon_ns_steps=4"],
    "ns3": ["optim.muon_ns_steps=3"],
    # Chen et al. 2023, section 5: a learning rate 3-10x below AdamW's, the weight decay as many times above;
    # betas (0.9, 0.99), the paper's default
    "lion": ["optim.name=lion", "optim.lr=1e-3", "optim.weight_decay=0.3", "optim.beta2=0.99"],
}
RECIPES = {  # name -> techniques added to the baseline
    "baseline": [],
    "compiled": ["compile"],
    "lr2x": ["lr2x"],
    "modded": ["wsd", "zero_init", "relu2", "qk_norm", "untied", "softcap"],
    "best": ["wsd", "zero_init", "relu2", "qk_norm", "untied", "softcap", "short"],
    "best-muon": ["wsd", "zero_init", "relu2", "qk_norm", "untied", "softcap", "short", "muon"],
    "best-b16": ["muon", "b16", "lr_hi", "sched240", "wsd", "untied", "zero_init", "relu2", "qk_norm", "softcap"],
    # best-b16 with the head tied again: its ablation found the untied head costing tokens (the shipped recipe
    # until 2026-12-03)
    "speedrun": ["muon", "b16", "lr_hi", "sched240", "wsd", "zero_init", "relu2", "qk_norm", "softcap"],
    # speedrun with the higher peaks and a 220-step schedule
    "speedrun-hi": ["muon", "b16", "lr_hi2", "sched220", "wsd", "zero_init", "relu2", "qk_norm", "softcap"],
    # speedrun-hi without the logit soft-cap: its ablation reached the target at the same step (210) without
    # it, and the cap's tanh is one more pass over the 16 x 256 x 4096 logits each way (bench/RESULTS.md)
    "speedrun-nocap": ["muon", "b16", "lr_hi2", "sched220", "wsd", "zero_init", "relu2", "qk_norm"],
    "lion": ["lion"],
}
SHIPPED = "speedrun-nocap"  # recipes/speedrun.yaml: the best recipe measured over three seeds (bench/RESULTS.md)


def overrides_of(techniques: list[str]) -> list[str]:
    return [o for name in techniques for o in TECHNIQUES[name]]


def plan_runs(recipes: list[str], ablation: bool | str) -> dict[str, list[str]]:
    """The recipes to run, baseline first: name -> techniques (ablation: the first candidate's
    techniques each added alone to the baseline and removed alone from the candidate)."""
    runs = {"baseline": []}
    for name in recipes:  # a recipe, or one technique alone on the baseline; "+technique" adds one
        first, *added = name.split("+")
        unknown = [part for part in added if part not in TECHNIQUES]
        if first not in RECIPES and first not in TECHNIQUES:
            unknown.insert(0, first)
        if unknown:
            raise LmforgeError(f"unknown recipe {unknown[0]!r}; recipes: {', '.join(RECIPES)}; or one technique: "
                               f"{', '.join(TECHNIQUES)}; a recipe+technique adds one")
        runs[name] = [*RECIPES.get(first, [first]), *added]
    if ablation:
        best = next((name for name in recipes if name != "baseline"), None)
        if best is None:
            raise LmforgeError("--ablation needs a candidate recipe besides the baseline")
        for technique in RECIPES[best]:
            if ablation != "removed":
                runs[f"+{technique}"] = [technique]
            if ablation != "added":
                runs[f"{best}-{technique}"] = [t for t in RECIPES[best] if t != technique]
    return runs


def train_command(model: str, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "lmforge", "train", "--model", model, "--out", str(run_dir), "--no-progress",
            *overrides]


def run_overrides(args, techniques: list[str], seed: int, data_dir: Path) -> list[str]:
    """Everything a run is given: measurement settings, the baseline, the recipe, the evaluation (and
    logging) interval of EVAL_TOKENS in the recipe's steps, then the user's."""
    given = [*MEASURE, f"train.max_steps={args.max_steps}", f"train.target_loss={args.target}",
             f"train.seed={FIRST_SEED + seed - 1}", f"data.dir={data_dir}", *BASELINE, *overrides_of(techniques)]
    cfg = make_config(args.model, overrides=[*given, *args.overrides])
    interval = max(1, EVAL_TOKENS // (cfg.train.batch_size * cfg.seq_len))
    return [*given, f"train.eval_interval={interval}", f"train.log_interval={interval}", *args.overrides]


def train_curve(run_dir: Path, summary: dict) -> list[tuple[float, int, float]]:
    """(training seconds, step, val loss) at each evaluation. The seconds of each logging window are
    its steps over its measured rate, scaled so that they sum to summary.json's training time, and
    the compile is added to the first window (evaluations fall on logged steps: run_overrides sets one
    interval for both)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r and r.get("tokens_per_s")]
    compile_s = summary["compile_seconds"] or 0.0
    tokens_per_step = summary["tokens_trained"] / summary["steps"]
    clock, last, at = 0.0, 0, {0: 0.0}
    for r in train:
        clock += (r["step"] - last - (1 if compile_s and last == 0 else 0)) * tokens_per_step / r["tokens_per_s"]
        at[r["step"]], last = clock, r["step"]
    scale = summary["train_seconds_this_session"] / clock if clock else 1.0
    return [(at[r["step"]] * scale + compile_s, r["step"], r["val_loss"])
            for r in records if "val_loss" in r and r["step"] in at]


def run_one(args, name: str, techniques: list[str], seed: int, data_dir: Path) -> dict:
    run_dir = args.out / f"seed{seed}" / name
    command = train_command(args.model, run_dir, run_overrides(args, techniques, seed, data_dir))
    env = dict(os.environ)
    if args.jobs > 1:  # the cores shared out, so that the runs do not spin against each other (OpenMP)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    started = time.time()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.time() - started
    (args.out / f"seed{seed}" / f"{name}.log").write_text(done.stdout)
    if done.returncode != 0:  # recorded, and the other runs go on
        error = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"  failed (exit {done.returncode}): {error}; log in {args.out}/seed{seed}/{name}.log", flush=True)
        return {"recipe": name, "seed": seed, "techniques": techniques, "failed": error, "reached_step": None,
                "seconds": None, "wall_seconds": wall, "tokens": None, "val_loss": None, "curve": []}
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["target_reached_step"]
    return {"recipe": name, "seed": seed, "techniques": techniques, "reached_step": step,
            "seconds": summary["train_seconds_this_session"] + (summary["compile_seconds"] or 0.0),
            "wall_seconds": wall, "tokens": summary["tokens_trained"] if step else None,
            "val_loss": summary["val_loss"], "tokens_per_s": summary["tokens_per_s"],
            "curve": train_curve(run_dir, summary), "run_dir": str(run_dir)}


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def ratios(results: list[dict]) -> dict[str, dict]:
    """Per candidate: time to target over its seed's baseline's, per seed and their geometric mean."""
    base = {r["seed"]: r for r in results if r["recipe"] == "baseline"}
    out = {}
    for r in results:
        b = base.get(r["seed"])
        if r["recipe"] == "baseline" or b is None:  # (--only without the baseline: tokens only)
            continue
        entry = out.setdefault(r["recipe"], {"per_seed": {}, "wall_per_seed": {}, "tokens_per_seed": {}})
        if r["reached_step"] and b["reached_step"]:
            entry["per_seed"][r["seed"]] = r["seconds"] / b["seconds"]
            entry["wall_per_seed"][r["seed"]] = r["wall_seconds"] / b["wall_seconds"]
            entry["tokens_per_seed"][r["seed"]] = r["tokens"] / b["tokens"]  # the load-free part of the gain
    for entry in out.values():
        for kind in ("", "wall_", "tokens_"):
            entry[f"{kind}geomean"] = geomean(list(entry[f"{kind}per_seed"].values()))
    return out


def report(results: list[dict], table: dict[str, dict], target: float) -> None:
    print(f"\ntarget {target} nats/token; time = training time to the target (steps and compile, not evaluation)")
    print(f"{'recipe':<24}{'seed':>5}{'step':>7}{'tokens':>12}{'time s':>9}{'wall s':>9}{'val loss':>10}"
          f"{'time/base':>11}")
    for r in results:
        ratio = table.get(r["recipe"], {}).get("per_seed", {}).get(r["seed"])
        if "failed" in r:
            print(f"{r['recipe']:<24}{r['seed']:>5}  failed: {r['failed']}")
            continue
        print(f"{r['recipe']:<24}{r['seed']:>5}{r['reached_step'] or '-':>7}{r['tokens'] or '-':>12}"
              f"{r['seconds']:>9.1f}{r['wall_seconds']:>9.1f}{r['val_loss']:>10.4f}"
              f"{'' if ratio is None else f'{ratio:.3f}':>11}")
    for name, entry in table.items():
        g, w, k = (("-" if x is None else f"{x:.3f}") for x in
                   (entry["geomean"], entry["wall_geomean"], entry["tokens_geomean"]))
        print(f"{name}: time/baseline geometric mean {g} over {len(entry['per_seed'])} seeds "
              f"(whole-process wall time: {w}; tokens to target: {k})")


def plot(results: list[dict], target: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for r in results:
        color = colors.setdefault(r["recipe"], f"C{len(colors) % 10}")
        seconds, _, losses = zip(*r["curve"]) if r["curve"] else ((), (), ())
        ax.plot(seconds, losses, color=color, alpha=0.8, label=r["recipe"] if r["seed"] == results[0]["seed"] else None)
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set(xlabel="training time to this evaluation (s; evaluation not counted)", ylabel="validation loss (nats/token)",
           title="speedrun: validation loss against training time")
    lowest = min((v for r in results for _, _, v in r["curve"]), default=target)
    ax.set_ylim(min(lowest, target) - 0.05, max(lowest, target) + 1.2)  # the approach to the target, not step 0
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="best", help=f"comma-separated candidates: {', '.join(RECIPES)}, "
                                                     f"or a technique alone: {', '.join(TECHNIQUES)}; "
                                                     f"recipe+technique adds one (speedrun+ns4)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--model", default="small")
    p.add_argument("--target", type=float, default=None, help="default: TARGETS[model] (small: 3.86)")
    p.add_argument("--max-steps", type=int, default=1000, help="a run that has not reached the target stops here")
    p.add_argument("--ablation", nargs="?", const=True, default=False, choices=[True, "added", "removed"],
                   help="each technique of the first candidate added alone and removed alone (or only one kind)")
    p.add_argument("--out", type=Path, default=HERE / "out" / f"speedrun-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--png", type=Path, default=HERE / "speedrun.png", help="the plot; the JSON results beside it")
    p.add_argument("--only", default=None, help="comma-separated: run only these of the planned runs (e.g. the "
                                                 "ablation's rows, the baseline and candidate measured before)")
    p.add_argument("--jobs", type=int, default=1, help="training processes at once (>1: tokens to target only, "
                                                       "times not compared)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run (e.g. data.source=...)")
    args = p.parse_args(argv)
    if args.target is None:
        if args.model not in TARGETS:
            p.error(f"no target known for --model {args.model}: pass --target")
        args.target = TARGETS[args.model]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = plan_runs([r for r in args.recipes.split(",") if r], args.ablation)
        if args.only is not None:
            only = [r for r in args.only.split(",") if r]
            unknown = [r for r in only if r not in runs]
            if unknown:
                raise LmforgeError(f"--only {','.join(unknown)}: not among the planned runs ({', '.join(runs)})")
            runs = {name: techniques for name, techniques in runs.items() if name in only}
        data_dir = data_dir_of(make_config(args.model, overrides=args.overrides)).resolve()
        for name, techniques in runs.items():  # every recipe is valid before anything runs
            try:
                make_config(args.model, overrides=run_overrides(args, techniques, 1, data_dir))
            except LmforgeError as err:
                raise LmforgeError(f"recipe {name}: {err}") from None
    except LmforgeError as err:
        print(f"speedrun: error: {err}", file=sys.stderr)
        return 2
    prepare = [sys.executable, "-m", "lmforge", "prepare", "--model", args.model, *args.overrides,
               f"data.dir={data_dir}"]
    if args.dry_run:
        print(" ".join(prepare))
        for seed in range(1, args.seeds + 1):
            for name, techniques in runs.items():
                run_dir = args.out / f"seed{seed}" / name
                print(" ".join(train_command(args.model, run_dir, run_overrides(args, techniques, seed, data_dir))))
        return 0
    subprocess.run(prepare, check=True, stdout=subprocess.DEVNULL)
    todo = [(seed, name, techniques) for seed in range(1, args.seeds + 1) for name, techniques in runs.items()]
    for seed in range(1, args.seeds + 1):
        (args.out / f"seed{seed}").mkdir(parents=True, exist_ok=True)

    def run(job):
        seed, name, techniques = job
        print(f"seed {seed}: {name} ...", flush=True)
        return run_one(args, name, techniques, seed, data_dir)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # results in the order of `todo`
        results = list(pool.map(run, todo))
    table = ratios(results)
    report(results, table, args.target)
    if args.jobs > 1:
        print(f"(--jobs {args.jobs}: the runs shared the machine; compare their tokens to target, not their times)")
    plot(results, args.target, args.png)
    args.png.with_suffix(".json").write_text(json.dumps(
        {"target": args.target, "model": args.model, "runs": results, "ratios": table, "argv": sys.argv[1:], "jobs": args.jobs,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}, indent=1))
    print(f"plot {args.png}, results {args.png.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
