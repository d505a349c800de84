"""Scaling laws: the loss a compute budget buys (Hoffmann et al. 2022, "Training Compute-Optimal
Large Language Models", "Chinchilla").

The parametric form (their eq. 2):

    L(N, D) = E + A / N^alpha + B / D^beta

N parameters, D training tokens. Approach 3 (their section 3.3) fits it by minimising the Huber loss
(delta 1e-3) between the log of the predicted and the log of the measured loss, written with a
log-sum-exp so the fit works on log A, log B, log E:

    log L = LSE(a - alpha log N, b - beta log D, e)

with L-BFGS from a grid of starting points, keeping the best. Approach 2 (section 3.2) is the IsoFLOP
one: at each compute budget C, runs of several sizes; a parabola in log N through their losses puts
the budget's best size at its vertex; log N_opt against log C is then a line, N_opt ~ C^a.

Counting, as in lmforge's 6N (accounting/shapes.py): N is the weights that multiply activations
(accounting/shapes.Shapes.matmul_weights: the LM head in, embedding lookups out; Kaplan et al.
2020 found small models follow one law only once the embedding is left out) and C = 6 N D.
"""

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, section 3.3
COUNTING = "N: matmul weights (LM head in, embedding lookups out); D: tokens trained; C = 6 N D"


@dataclass(frozen=True)
class ScalingFit:
    """L(N, D) = E + A / N^alpha + B / D^beta, fitted to `points` runs (Huber objective `objective`)."""
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    points: int = 0
    objective: float = 0.0

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L under C = 6 N D: their eq. 4,
        N_opt = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta)), D_opt = C/(6 N_opt)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * (flops / 6) ** (self.beta / (self.alpha + self.beta))
        return n, flops / (6 * n)

    def as_dict(self) -> dict:
        return asdict(self)


def huber(residual: torch.Tensor, delta: float = HUBER_DELTA) -> torch.Tensor:
    small = residual.abs() <= delta
    return torch.where(small, 0.5 * residual ** 2, delta * (residual.abs() - 0.5 * delta))


def _objective(theta: torch.Tensor, log_n, log_d, log_l) -> torch.Tensor:
    """The Huber objective of each row of `theta` = (a, b, e, alpha, beta) rows: shape (S,). The
    runs' logs are (P,), or (S, P) for one resampled set of runs per row (the bootstrap)."""
    a, b, e, alpha, beta = theta.unbind(-1)
    terms = torch.stack(torch.broadcast_tensors(a[:, None] - alpha[:, None] * log_n,
                                                b[:, None] - beta[:, None] * log_d, e[:, None]))
    return huber(torch.logsumexp(terms, dim=0) - log_l).sum(-1)


def _descend(starts: torch.Tensor, log_n, log_d, log_l, steps: int = 500, lr: float = 0.05) -> torch.Tensor:
    """Every start descended at once with Adam, which adapts each coordinate on its own and so keeps
    the starts independent (the objective is their sum): a batched stand-in for one L-BFGS per start."""
    theta = starts.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        _objective(theta, log_n, log_d, log_l).sum().backward()
        optimizer.step()
        schedule.step()
    return theta.detach()


def _lbfgs(theta0: torch.Tensor, log_n, log_d, log_l, iterations: int = 500) -> tuple[float, torch.Tensor]:
    """L-BFGS from one start (their section 3.3's optimiser): (objective, theta)."""
    theta = theta0.clone()[None].requires_grad_(True)
    optimizer = torch.optim.LBFGS([theta], lr=1.0, max_iter=iterations, tolerance_grad=1e-12,
                                  tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        value = _objective(theta, log_n, log_d, log_l).sum()
        value.backward()
        return value

    optimizer.step(closure)
    with torch.no_grad():
        return _objective(theta, log_n, log_d, log_l).item(), theta.detach()[0]


# The paper's grid of starts (section D.2): alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
# a, b in {0, 5, ..., 25}: 4,500 starts. COARSE_GRID is a subset for tests and quick looks.
PAPER_GRID = dict(alpha=[0, 0.5, 1, 1.5, 2], beta=[0, 0.5, 1, 1.5, 2], e=[-1, -0.5, 0, 0.5, 1],
                  a=[0, 5, 10, 15, 20, 25], b=[0, 5, 10, 15, 20, 25])
COARSE_GRID = dict(alpha=[0.25, 0.75], beta=[0.25, 0.75], e=[-1, 0, 1], a=[0, 5, 10], b=[0, 5, 10])


def fit_parametric(n: list[float], d: list[float], loss: list[float], grid: dict = PAPER_GRID,
                   polished: int = 4) -> ScalingFit:
    """Approach 3: every start in `grid` descended together (_descend), then L-BFGS from the
    `polished` best to convergence; the lowest objective kept."""
    if len(n) < 5:
        raise ValueError(f"a fit of 5 constants needs at least 5 runs, got {len(n)}")
    log_n, log_d, log_l = (torch.tensor(v, dtype=torch.float64).log() for v in (n, d, loss))
    starts = torch.tensor([[a, b, e, alpha, beta] for alpha, beta, e, a, b in itertools.product(
        grid["alpha"], grid["beta"], grid["e"], grid["a"], grid["b"])], dtype=torch.float64)
    descended = _descend(starts, log_n, log_d, log_l)
    with torch.no_grad():
        values = _objective(descended, log_n, log_d, log_l).nan_to_num(math.inf)
    candidates = [_lbfgs(descended[i], log_n, log_d, log_l) for i in values.argsort()[:polished].tolist()]
    value, (a, b, e, alpha, beta) = min((c for c in candidates if math.isfinite(c[0])), key=lambda c: c[0])
    return ScalingFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta),
                      points=len(n), objective=value)


def bootstrap(n, d, loss, fit: ScalingFit, samples: int = 200, seed: int = 0) -> dict[str, tuple[float, float]]:
    """5th-95th percentile of each constant over `samples` refits on runs resampled with
    replacement, all descended together from `fit`, the full data's optimum."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(n), (samples, len(n)), generator=g)
    log_n, log_d, log_l = (torch.tensor(v, dtype=torch.float64).log()[picks] for v in (n, d, loss))
    logs = [math.log(max(v, 1e-300)) for v in (fit.A, fit.B, fit.E)]  # E may underflow to 0 on few runs
    start = torch.tensor([*logs, fit.alpha, fit.beta], dtype=torch.float64)
    a, b, e, alpha, beta = _descend(start.expand(samples, 5), log_n, log_d, log_l, steps=300, lr=0.005).unbind(-1)
    values = {"E": e.exp(), "A": a.exp(), "B": b.exp(), "alpha": alpha, "beta": beta}
    return {key: (float(v.quantile(0.05)), float(v.quantile(0.95))) for key, v in values.items()}


@dataclass(frozen=True)
class IsoFlopMinimum:
    flops: float
    n_opt: float
    loss: float  # the parabola's value at its vertex


def isoflop_minima(runs: list[tuple[float, float, float]]) -> list[IsoFlopMinimum]:
    """Approach 2: `runs` as (C, N, L); for each budget with 3 or more sizes, the vertex of the
    least-squares parabola L = c2 x^2 + c1 x + c0 in x = log N."""
    minima = []
    for flops in sorted({round(c, 6) for c, _, _ in runs}):
        group = [(math.log(n), loss) for c, n, loss in runs if math.isclose(c, flops, rel_tol=1e-6)]
        if len(group) < 3:
            continue
        x = torch.tensor([g[0] for g in group], dtype=torch.float64)
        y = torch.tensor([g[1] for g in group], dtype=torch.float64)
        c2, c1, c0 = torch.linalg.lstsq(torch.stack([x ** 2, x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0]
        if c2 <= 0:  # no minimum inside: the sizes do not bracket the budget's best
            continue
        vertex = -c1 / (2 * c2)
        minima.append(IsoFlopMinimum(flops, math.exp(vertex), float(c0 - c1 ** 2 / (4 * c2))))
    return minima


def power_law(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(exponent, coefficient) of y = coefficient x^exponent, least squares in log-log."""
    x = torch.tensor(xs, dtype=torch.float64).log()
    y = torch.tensor(ys, dtype=torch.float64).log()
    slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0]
    return float(slope), math.exp(float(intercept))


# -- the sweep's grid ------------------------------------------------------------------------------------

HEAD_DIM = 32  # every sweep model's heads are this wide
WIDTH_PER_LAYER = 32  # d_model = 32 x n_layers: depth and width grow together (one rule for the sweep)


def sweep_model(depth: int, vocab_size: int, seq_len: int) -> dict:
    """The ModelConfig fields of the sweep's model of `depth` layers."""
    d_model = WIDTH_PER_LAYER * depth
    return dict(family="llama", vocab_size=vocab_size, d_model=d_model, n_layers=depth,
                n_heads=d_model // HEAD_DIM, n_kv_heads=d_model // HEAD_DIM, max_seq_len=seq_len)


@dataclass(frozen=True)
class SweepRun:
    """One run of an IsoFLOP sweep: the model of `depth` layers trained on C / (6 N) tokens."""
    flops: float
    depth: int
    parameters: int  # N: the matmul weights (the module docstring)
    steps: int
    tokens: int

    @property
    def name(self) -> str:
        return f"C{self.flops:.3g}-L{self.depth}".replace("+", "")


def sweep_grid(depths: list[int], budgets: list[float], vocab_size: int, seq_len: int,
               tokens_per_step: int, min_steps: int = 50) -> tuple[list[SweepRun], list[SweepRun]]:
    """(runs, left out): every depth at every budget, D = C / (6 N) rounded to whole steps; a run
    of fewer than `min_steps` steps is left out (too short for warm-up and decay to mean anything)."""
    from lmforge.accounting.shapes import model_shapes
    from lmforge.config import ModelConfig

    runs, left_out = [], []
    for flops in budgets:
        for depth in depths:
            n = model_shapes(ModelConfig(**sweep_model(depth, vocab_size, seq_len))).matmul_weights
            steps = round(flops / (6 * n) / tokens_per_step)
            run = SweepRun(flops, depth, n, steps, steps * tokens_per_step)
            (runs if steps >= min_steps else left_out).append(run)
    return runs, left_out


def read_fit(path: str, option: str = "--scaling") -> ScalingFit:
    """The fit `lmforge scaling fit --out` wrote, checked; `option` names where the path came from
    (a command-line option or a config key)."""
    import json

    from lmforge.common.errors import LmforgeError

    where = f"{option} {path}" if option.startswith("--") else f"{option}={path}"
    try:
        values = json.loads(open(path, encoding="utf-8").read())["fit"]
        fit = ScalingFit(**values)
    except FileNotFoundError:
        raise LmforgeError(f"{where}: no such file (lmforge scaling fit RUNS --out {path} writes it)") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise LmforgeError(f"{where}: not a fit written by lmforge scaling fit --out") from None
    if not (all(math.isfinite(v) and v > 0 for v in (fit.A, fit.B, fit.alpha, fit.beta))
            and math.isfinite(fit.E) and fit.E >= 0):
        raise LmforgeError(f"{where}: the fit's constants must be finite, E >= 0 and the rest positive")
    return fit


def predicted_loss(fit: ScalingFit, n: int, tokens: float) -> dict:
    """The plan's row: the loss the fit predicts for N and D, and the compute-optimal split of the
    same compute C = 6 N D."""
    flops = 6 * n * tokens
    n_opt, d_opt = fit.compute_optimal(flops)
    return {"parameters": n, "tokens": tokens, "flops_6nd": flops, "loss": fit.loss(n, tokens),
            "compute_optimal_parameters": n_opt, "compute_optimal_tokens": d_opt,
            "compute_optimal_loss": fit.loss(n_opt, d_opt), "counting": COUNTING}


def plot_scaling(points: list[tuple[float, float, float]], fit: ScalingFit, minima: list[IsoFlopMinimum],
                 png: str | Path) -> None:
    """The scaling-law picture: IsoFLOP curves (loss against N at each budget, runs as points, the
    fit's L(N, C / 6N) as lines, each budget's best size marked) and N_opt against C. `points` as
    (C, N, L) of the runs."""
    from lmforge.accounting.plan.chart import pyplot, save  # matplotlib: when a chart is drawn

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
