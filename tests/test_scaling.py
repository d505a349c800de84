"""Scaling laws (lmforge/accounting/scaling.py, `lmforge scaling`, `plan --scaling`).

On synthetic losses drawn from known constants (Hoffmann et al. 2022's own fit: E 1.69, A 406.4,
B 410.7, alpha 0.34, beta 0.28) with 0.2% multiplicative noise, the Huber fit recovers the
exponents within 0.01 and E within 5%, and the compute-optimal N within 5%: a fit with the wrong
sign, a missing log or a wrong optimum formula misses these by far more. The slow test trains a
real (tiny) IsoFLOP sweep through the CLI and fits it.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from lmforge.accounting.scaling import (ScalingFit, bootstrap, fit_parametric, isoflop_minima,
                                        power_law, predicted_loss, read_fit, sweep_grid)
from lmforge.cli.commands import main
from lmforge.common.errors import LmforgeError

CHINCHILLA = ScalingFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
# 8 of the coarse grid's starts, far from the answer (a, b = log A, log B = 6.0): enough here, where
# each L-BFGS run converges; the CLI's default tries 108
FEW_STARTS = dict(alpha=[0.5], beta=[0.5], e=[0, 1], a=[0, 10], b=[0, 10])


def synthetic_sweep(fit: ScalingFit, noise: float = 0.002):
    """An IsoFLOP design: 5 sizes at each of 4 budgets, losses from `fit` with noise."""
    g = torch.Generator().manual_seed(0)
    runs = []
    for flops in (1e15, 1e16, 1e17, 1e18):
        for n in (1e5, 3e5, 1e6, 3e6, 1e7):
            d = flops / (6 * n)
            runs.append((flops, n, d, fit.loss(n, d) * math.exp(noise * torch.randn(1, generator=g).item())))
    return runs


def test_the_huber_fit_recovers_known_constants():
    runs = synthetic_sweep(CHINCHILLA)
    fit = fit_parametric([r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs], FEW_STARTS)
    assert fit.alpha == pytest.approx(CHINCHILLA.alpha, abs=0.01)
    assert fit.beta == pytest.approx(CHINCHILLA.beta, abs=0.01)
    assert fit.E == pytest.approx(CHINCHILLA.E, rel=0.05)
    for flops in (1e19, 1e21):  # extrapolated past the sweep's budgets
        assert fit.compute_optimal(flops)[0] == pytest.approx(CHINCHILLA.compute_optimal(flops)[0], rel=0.05)
    intervals = bootstrap([r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs], fit, samples=20)
    assert intervals["alpha"][0] <= fit.alpha <= intervals["alpha"][1]
    assert intervals["alpha"][1] - intervals["alpha"][0] < 0.05


def test_the_compute_optimal_split_minimises_the_loss_at_fixed_compute():
    flops = 1e20
    n_opt, d_opt = CHINCHILLA.compute_optimal(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    best = CHINCHILLA.loss(n_opt, d_opt)
    for factor in (0.8, 0.95, 1.05, 1.25):  # any other split of the same compute does worse
        n = n_opt * factor
        assert CHINCHILLA.loss(n, flops / (6 * n)) > best


def test_isoflop_minima_find_each_parabolas_vertex_and_the_exponent():
    # exact parabolas in log N with vertices on N_opt = 0.1 C^0.5: the minima and the exponent come back
    runs = []
    for flops in (1e12, 1e14, 1e16):
        vertex = math.log(0.1 * flops ** 0.5)
        for x in (vertex - 1.5, vertex - 0.5, vertex + 0.2, vertex + 1.0):
            runs.append((flops, math.exp(x), 3.0 + 0.2 * (x - vertex) ** 2))
    minima = isoflop_minima(runs)
    assert [m.n_opt for m in minima] == pytest.approx([0.1 * c ** 0.5 for c in (1e12, 1e14, 1e16)], rel=1e-9)
    assert all(m.loss == pytest.approx(3.0) for m in minima)
    exponent, coefficient = power_law([m.flops for m in minima], [m.n_opt for m in minima])
    assert (exponent, coefficient) == pytest.approx((0.5, 0.1), rel=1e-9)


def test_the_sweep_grid_spends_each_budget_and_leaves_out_runs_too_short():
    runs, left_out = sweep_grid([2, 4, 8], [1e12], vocab_size=4096, seq_len=128, tokens_per_step=1024)
    for run in runs:
        assert 6 * run.parameters * run.tokens == pytest.approx(1e12, rel=0.01)
        assert run.tokens == run.steps * 1024
    assert [r.depth for r in left_out] == [8] and left_out[0].steps < 50
    assert runs[0].name == "C1e12-L2"


def test_plan_adds_the_predicted_loss(tmp_path, capsys):
    fit_file = tmp_path / "fit.json"
    fit_file.write_text(json.dumps({"fit": CHINCHILLA.as_dict()}))
    assert main(["plan", "--model", "tiny", "--tokens", "1e9", "--scaling", str(fit_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    s = plan["scaling"]
    assert s["loss"] == pytest.approx(CHINCHILLA.loss(s["parameters"], 1e9))
    assert s["compute_optimal_loss"] <= s["loss"]
    assert predicted_loss(CHINCHILLA, s["parameters"], 1e9) == s


def test_a_run_sets_its_validation_loss_beside_the_fits_prediction(tmp_path, corpus_dir, data_dir, capsys):
    """train.scaling_fit: the plan printed at the start and the summary carry the fit's loss for this
    model at max_steps' tokens; a missing fit stops the run before its folder is made."""
    from lmforge.accounting.shapes import model_shapes
    from lmforge.config import make_config
    from tests.conftest import tiny_overrides

    fit_file = tmp_path / "fit.json"
    fit_file.write_text(json.dumps({"fit": CHINCHILLA.as_dict()}))
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=2, eval_interval=2, checkpoint_interval=2)
    assert main(["train", "--model", "tiny", "--out", str(tmp_path / "missing"), "--no-progress", *overrides,
                 f"train.scaling_fit={tmp_path / 'nofit.json'}"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"train.scaling_fit={tmp_path / 'nofit.json'}: no such file "
                                                    f"(lmforge scaling fit RUNS --out {tmp_path / 'nofit.json'} writes it)")
    assert not (tmp_path / "missing" / "config.yaml").exists()
    assert main(["train", "--model", "tiny", "--out", str(tmp_path / "r"), "--no-progress", *overrides,
                 f"train.scaling_fit={fit_file}"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    cfg = make_config("tiny", overrides=overrides)
    predicted = summary["val_loss_predicted_by_fit"]
    assert predicted["tokens"] == summary["tokens_trained"] == 2 * 4 * cfg.seq_len
    assert predicted["parameters"] == model_shapes(cfg.model).matmul_weights
    assert predicted["loss"] == pytest.approx(CHINCHILLA.loss(predicted["parameters"], predicted["tokens"]))
    assert "predicted final loss (scaling fit)" in out and "validation loss, the scaling fit's" in out


@pytest.mark.parametrize("content, words", [(None, "no such file"), ("{}", "not a fit"), ("\xff", "not a fit"),
                                            ('{"fit": {"E": 1, "A": 1, "B": 1, "alpha": -1, "beta": 1}}',
                                             "must be finite")])
def test_a_bad_fit_file_is_one_line(tmp_path, content, words):
    path = tmp_path / "fit.json"
    if content is not None:
        path.write_text(content, encoding="latin-1")
    with pytest.raises(LmforgeError, match=words):
        read_fit(str(path))


@pytest.mark.slow
def test_a_real_sweep_trains_resumes_and_fits(tmp_path, corpus_dir, data_dir):
    """Six tiny runs (3 depths x 2 budgets) through `lmforge scaling sweep`, then the fit."""
    out = tmp_path / "sweep"
    sweep = [sys.executable, "-m", "lmforge", "scaling", "sweep", "--out", str(out), "--depths", "1,2,3",
             "--budgets", "2e10,6e10", "--seq-len", "32", "--vocab-size", "512", f"data.source={corpus_dir}",
             f"data.dir={data_dir}", "train.batch_size=4", "train.log_interval=50"]
    done = subprocess.run(sweep, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    finished = sorted(p.name for p in out.iterdir() if (p / "summary.json").is_file())
    assert len(finished) == 6
    again = subprocess.run(sweep, capture_output=True, text=True, timeout=300)  # every run finished: skipped
    assert again.returncode == 0 and "val loss" not in again.stdout

    def fit_runs(name: str, max_passes: float) -> dict:
        fitted = subprocess.run([sys.executable, "-m", "lmforge", "scaling", "fit", str(out), "--out",
                                 str(tmp_path / name), "--plot", str(tmp_path / "fit.png"), "--bootstrap", "10",
                                 "--max-passes", str(max_passes)], capture_output=True, text=True, timeout=600)
        assert fitted.returncode == 0, fitted.stderr[-3000:]
        return json.loads((tmp_path / name).read_text())

    report = fit_runs("fit.json", 1e6)  # the test corpus is small: some runs read it more than once
    assert len(report["runs"]) == 6 and (tmp_path / "fit.png").stat().st_size > 10_000
    split = json.loads((data_dir / "meta.json").read_text())["splits"]["train"]["tokens"]
    for run in report["runs"]:
        assert run["passes"] == pytest.approx(run["tokens"] / split)
    # --max-passes leaves out exactly the runs that read their split more often than it allows
    most, second = sorted(report["runs"], key=lambda run: run["passes"])[-1:-3:-1]
    assert most["passes"] > second["passes"]
    fewer = fit_runs("fewer.json", second["passes"])
    assert [run["name"] for run in fewer["left_out_repeated"]] == [most["name"]]
    assert sorted(run["name"] for run in fewer["runs"]) == sorted(r["name"] for r in report["runs"] if r is not most)
    fit = read_fit(str(tmp_path / "fit.json"))
    for run in report["runs"]:  # the fit passes near every run it was fitted to
        assert fit.loss(run["parameters"], run["tokens"]) == pytest.approx(run["val_loss"], rel=0.05)
