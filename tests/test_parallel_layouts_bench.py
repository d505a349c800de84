"""bench/parallel_layouts.py's parts, without its runs: every layout is a config the trainer's launch
check accepts on its number of ranks, its arguments are checked, and its table and plot read the
trainer's predicted-vs-measured rows (train/summary.py) as the trainer names them."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmforge.accounting.plan.make import Costing, data_parallel, make_plan
from lmforge.config import make_config
from lmforge.parallel.world import check_launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # it imports pipeline_bubble's corpus, as when run as a script
    spec = importlib.util.spec_from_file_location("parallel_layouts", ROOT / "bench" / "parallel_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layout_launches_on_its_ranks_and_has_a_plan(bench):
    assert {"tp2", "tp2-sp", "tp2xddp2", "tp2xzero3", "cp2", "tp2xcp2", "pp2xtp2"} <= set(bench.LAYOUTS)
    for name, (ranks, overrides) in bench.LAYOUTS.items():
        cfg = make_config("tiny", overrides=[*overrides, "train.sample_tokens=0", "train.device=cpu"])
        assert check_launch(cfg, (0, ranks, 0), cuda_devices=0) == torch.device("cpu"), name
        c = cfg.parallel
        assert c.tp * c.cp * c.pp <= ranks, name  # the rest are data-parallel replicas
        plan = make_plan(cfg, Costing(dp=data_parallel(cfg, ranks)), ("this", 1e12, 1e12))  # as the trainer plans
        # a pipeline's plan counts its stages' memory and dp traffic, not yet their tp traffic (bench/RESULTS.md)
        assert ("tensor_parallel" in plan["communication"]) == (c.tp > 1), name  # pipelines of tp stages too
        assert ("context_parallel" in plan["communication"]) == (c.cp > 1), name


def test_arguments(bench, capsys):
    args = bench.parse_args([])
    assert args.layout == list(bench.LAYOUTS) and args.steps >= 1
    assert bench.parse_args(["--layout", "cp2, tp2"]).layout == ["cp2", "tp2"]
    for bad in (["--layout", "tp3"], ["--layout", ","], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert "unknown tp3" in capsys.readouterr().err


def row(predicted, measured):
    return {"predicted": predicted, "measured": measured}


def test_table_and_plot_from_trainer_rows(bench, tmp_path):
    """A plain layout's rows per rank; a pipeline's per stage (its "stage S ..." rows)."""
    plain = {"parameters_bytes": row(2048, 2048), "gradients_bytes": row(2048, 2048),
             "optimizer_states_bytes": row(4096, 4096), "activations_bytes": row(8192, 9216),
             "sent_bytes_per_step": row(1024, 1024), "tp_sent_bytes_per_step": row(512, 512), "mfu": row(1.0, 0.1)}
    staged = {f"stage {s} {k}": row(1024 * (s + 1), 1024 * (s + 1)) for s in (0, 1) for k in bench.MEMORY}
    staged["sent_bytes_per_step"] = row(0.0, 0.0)
    results = {"tp2": [plain, plain], "pp2": [staged, staged]}
    assert bench.rows_of(plain)["activations"] == (8192, 9216)
    assert bench.rows_of(staged, 1)["parameters"] == (2048, 2048)
    lines = bench.format_table(results).splitlines()
    assert len([line for line in lines if line.startswith("tp2 ")]) == 2  # one per rank
    assert [line.split()[1:3] for line in lines if line.startswith("pp2 ")] == [["st", "0"], ["st", "1"]]
    tp_row = next(line for line in lines if line.startswith("tp2 "))
    assert "8.0/      9.0 1.125" in tp_row and "0.5/      0.5 1.000" in tp_row
    bench.plot(results, tmp_path / "layouts.png")
    assert (tmp_path / "layouts.png").stat().st_size > 10_000


@pytest.mark.dist
def test_the_bench_runs_tp2_and_every_rank_measures_the_plan(bench, tmp_path):
    """The bench itself on its cheapest layout (2 gloo ranks, one step): each rank's table has the
    memory and tp rows, every one measured equal to the plan (the bytes are exact: ==)."""
    import json
    import subprocess
    out = tmp_path / "tp2.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_layouts.py"), "--layout", "tp2", "--steps", "1",
                    "--json", str(out), "--out", str(tmp_path / "tp2.png")], check=True, timeout=300,
                   capture_output=True)
    ranks = json.loads(out.read_text())["tp2"]
    assert len(ranks) == 2
    for table in ranks:
        rows = bench.rows_of(table)
        assert set(rows) == {"parameters", "gradients", "optimizer_states", "activations", "sent tp"}
        assert all(planned == measured for planned, measured in rows.values()), rows
