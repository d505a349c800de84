"""What a token costs under each speedrun recipe, measured in one run (issue 27 part 5, the ablation).

    python bench/speedrun_cost.py --recipes best-b16 [--ablation] [--steps 50] [--skip 10] [--rounds 2]
                                  [--tokens SPEEDRUN.json] [section.key=value ...]

A recipe's time to the target is its tokens to the target times its time per token. The first
factor does not depend on the machine's load (bench/speedrun.py --jobs 2 measures it for many
recipes at once); the second does, and is measured here: every recipe (the same list as
bench/speedrun.py plans, baseline first) trains --steps steps, one process at a time on the whole
machine, in --rounds alternating rounds, without evaluation; its tokens/s over its steps after the
first --skip (metrics.jsonl's logged windows: the first window holds the first allocations, the
optimizer's state being made and, under train.compile, the compile) is set against the baseline's of
the same round, and the rounds' ratios are averaged geometrically. (Counting every step instead, as
this script first did, read `speedrun-hi` at 0.84x the baseline's tokens/s in 30-step runs, where its
full-length timed runs measured 0.87-0.96x and this rule 0.90x: bench/RESULTS.md.) With --tokens (a
bench/speedrun.py results file), each recipe's estimated time to target over the baseline's is
printed: (tokens ratio) / (tokens/s ratio).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speedrun  # noqa: E402  (bench/speedrun.py: the recipes, the baseline, the run's settings)


def cost_overrides(args, techniques: list[str], round_: int, data_dir: Path) -> list[str]:
    """A run of --steps steps of the recipe, no evaluation, no target, logged every --skip steps."""
    return [*speedrun.MEASURE, f"train.max_steps={args.steps}", "train.eval_interval=0",
            f"train.log_interval={args.skip}", f"train.seed={speedrun.FIRST_SEED + round_ - 1}",
            f"data.dir={data_dir}", *speedrun.BASELINE, *speedrun.overrides_of(techniques), *args.overrides]


def steady_tokens_per_second(run_dir: Path) -> float:
    """Tokens over seconds of the logged windows after the first (each window's seconds: its tokens over
    its measured rate)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens_per_step = summary["tokens_trained"] / summary["steps"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train_loss" in r and r.get("tokens_per_s")]
    tokens = seconds = 0.0
    for before, window in zip(windows, windows[1:]):
        n = (window["step"] - before["step"]) * tokens_per_step
        tokens, seconds = tokens + n, seconds + n / window["tokens_per_s"]
    if not seconds:
        raise SystemExit(f"speedrun_cost: error: {run_dir} logged one window: --steps must be above --skip")
    return tokens / seconds


def tokens_per_second(args, name: str, techniques: list[str], round_: int, data_dir: Path) -> float:
    run_dir = args.out / f"round{round_}" / name
    command = speedrun.train_command(args.model, run_dir, cost_overrides(args, techniques, round_, data_dir))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return steady_tokens_per_second(run_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="best-b16")
    p.add_argument("--ablation", nargs="?", const=True, default=False, choices=[True, "added", "removed"])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="the first steps, left out of the rate (and the log interval)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=Path, help="bench/speedrun.py's results (JSON): print estimated time ratios")
    p.add_argument("--out", type=Path, default=speedrun.HERE / "out" / "speedrun-cost")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if not 0 < args.skip < args.steps:
        p.error(f"--skip {args.skip} must be at least 1 and below --steps {args.steps}: the rate is of the steps after it")
    runs = speedrun.plan_runs([r for r in args.recipes.split(",") if r], args.ablation)
    data_dir = speedrun.data_dir_of(speedrun.make_config(args.model, overrides=args.overrides)).resolve()
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--model", args.model, *args.overrides,
                    f"data.dir={data_dir}"], check=True, stdout=subprocess.DEVNULL)
    rates = {name: [] for name in runs}
    for round_ in range(1, args.rounds + 1):
        for name, techniques in runs.items():
            rates[name].append(tokens_per_second(args, name, techniques, round_, data_dir))
            print(f"round {round_}: {name}: {rates[name][-1]:,.0f} tokens/s", flush=True)
    cost = {name: speedrun.geomean([r / b for r, b in zip(rates[name], rates["baseline"])]) for name in runs}
    tokens = {}
    if args.tokens:
        table = json.loads(args.tokens.read_text())["ratios"]
        tokens = {name: entry["tokens_geomean"] for name, entry in table.items()}
    print(f"\n{'recipe':<28}{'tokens/s vs baseline':>22}{'tokens to target':>18}{'est. time / baseline':>22}")
    for name in runs:
        t = 1.0 if name == "baseline" else tokens.get(name)
        est = None if t is None else t / cost[name]
        print(f"{name:<28}{cost[name]:>22.3f}{'-' if t is None else f'{t:.3f}':>18}"
              f"{'-' if est is None else f'{est:.3f}':>22}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(json.dumps({"rates": rates, "cost_ratio": cost, "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
