"""The scaling-law picture: IsoFLOP curves (loss against N at each budget, runs as points, the
fit's L(N, C / 6N) as lines, each budget's best size marked) and N_opt against C."""

import math
from pathlib import Path

from lmforge.accounting.plan.chart import pyplot, save
from lmforge.accounting.scaling import IsoFlopMinimum, ScalingFit


def plot_scaling(points: list[tuple[float, float, float]], fit: ScalingFit, minima: list[IsoFlopMinimum],
                 png: str | Path) -> None:
    """`points` as (C, N, L) of the runs."""
    plt = pyplot()
    fig, (curves, optimal) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    budgets = sorted({round(c, 6) for c, _, _ in points})
    colors = plt.cm.viridis([i / max(len(budgets) - 1, 1) for i in range(len(budgets))])
    sizes = [n for _, n, _ in points]
    lo, hi = math.log(min(sizes) / 2), math.log(max(sizes) * 2)
    grid = [math.exp(lo + (hi - lo) * i / 99) for i in range(100)]
    for flops, color in zip(budgets, colors):
        runs = sorted((n, loss) for c, n, loss in points if math.isclose(c, flops, rel_tol=1e-6))
        curves.scatter(*zip(*runs), color=color, zorder=3, label=f"C = {flops:.0e}")
        curves.plot(grid, [fit.loss(n, flops / (6 * n)) for n in grid], color=color, alpha=0.7)
        n_opt, d_opt = fit.compute_optimal(flops)
        curves.scatter([n_opt], [fit.loss(n_opt, d_opt)], marker="*", s=120, color=color, edgecolor="black")
    curves.set_xscale("log")
    curves.set_xlabel("parameters N (matmul weights)")
    curves.set_ylabel("final validation loss")
    curves.set_title(f"IsoFLOP: L = {fit.E:.2f} + {fit.A:.3g}/N^{fit.alpha:.2f} + {fit.B:.3g}/D^{fit.beta:.2f}",
                     fontsize=9)
    curves.legend(fontsize=7)
    span = [min(budgets) / 3, max(budgets) * 30]
    optimal.plot(span, [fit.compute_optimal(c)[0] for c in span], label="parametric fit (approach 3)")
    if minima:
        optimal.scatter([m.flops for m in minima], [m.n_opt for m in minima], color="tab:red", zorder=3,
                        label="IsoFLOP minima (approach 2)")
    optimal.set_xscale("log")
    optimal.set_yscale("log")
    optimal.set_xlabel("compute C = 6 N D (FLOPs)")
    optimal.set_ylabel("compute-optimal N")
    optimal.legend(fontsize=8)
    save(plt, fig, png)
