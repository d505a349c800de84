"""`lmforge plan --compare` (several setups, one table, one PNG) and `--solve`."""

import itertools
import json

import pytest

from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.common.errors import LmforgeError
from lmforge.cli import main
from lmforge.config import make_config

LLAMA_8B = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--batch-size", "1", "--precision", "bf16-mixed",
            "--hardware", "h100-sxm"]


def test_compare_plans_every_combination_as_one_table_and_one_png(tmp_path, capsys):
    png = tmp_path / "compare.png"
    assert main([*LLAMA_8B, "--dp", "8", "--compare", "--zero-stage", "0,1,2,3", "--recompute", "none,full",
                 "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [(p["setup"]["zero_stage"], p["setup"]["recompute"]) for p in plans] == list(
        itertools.product([0, 1, 2, 3], ["none", "full"]))
    alone = make_plan(make_config("llama3-8b", overrides=["train.batch_size=1", "train.seq_len=8192",
                                                          "train.parallel=zero2", "train.precision=bf16-mixed",
                                                          "train.recompute=full"]),
                      Costing(hardware="h100-sxm", dp=8))
    assert plans[5]["memory"] == alone["memory"]  # each row is the plan of that setup alone
    assert main([*LLAMA_8B, "--dp", "8", "--compare", "--zero-stage", "0,1,2,3", "--recompute", "none,full",
                 "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert len(rows) == 8 and "zero stage" in "\n".join(lines) and "recompute FLOPs" in "\n".join(lines)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--zero-stage", "0,3"], "--zero-stage 0,3: several values need --compare"),
    (["--compare"], "--compare needs an option with several values"),
    (["--compare", "--dp", "1,x"], "--dp 1,x: each value must be an integer"),
    (["--compare", "--tp", "1,2", "--solve", "batch"], "--compare and --solve do not go together"),
])
def test_compare_bad_input_is_one_line(args, message, capsys):
    assert main(["plan", "--model", "tiny", "--hardware", "a100", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmforge: error: {message}") and err.count("\n") == 1


def solved(args, capsys) -> tuple[dict, str]:
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    return plan, capsys.readouterr().out


def test_solve_batch_finds_the_largest_micro_batch_that_fits(capsys):
    plan, out = solved(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--precision", "bf16-mixed",
                        "--hardware", "h100-sxm", "--zero-stage", "3", "--dp", "8", "--recompute", "full",
                        "--solve", "batch"], capsys)
    b = plan["setup"]["batch_size"]
    def fits(batch):
        cfg = make_config("llama3-8b", overrides=[f"train.batch_size={batch}", "train.seq_len=4096",
                                                  "train.parallel=zero3", "train.precision=bf16-mixed",
                                                  "train.recompute=full"])
        return make_plan(cfg, Costing(hardware="h100-sxm", dp=8))["memory"]["fits"]
    assert b > 1 and fits(b) and not fits(b + 1)
    assert f"--solve batch: {b} is the largest batch that fits" in out


def test_solve_devices_finds_the_fewest_that_fit(capsys):
    args = ["plan", "--model", "llama3-70b", "--seq-len", "4096", "--batch-size", "1", "--precision", "bf16-mixed",
            "--hardware", "h100-sxm", "--zero-stage", "3", "--recompute", "full", "--solve", "devices"]
    plan, out = solved(args, capsys)
    st = plan["setup"]
    assert plan["memory"]["fits"] and f"--solve devices: {st['devices']} device(s)" in out
    setup = ["train.batch_size=1", "train.seq_len=4096", "train.precision=bf16-mixed", "train.recompute=full"]

    def fits(*overrides, dp=1):
        return make_plan(make_config("llama3-70b", overrides=[*setup, *overrides]),
                         Costing(hardware="h100-sxm", dp=dp))["memory"]["fits"]
    # a pipeline's replicas take ZeRO-1 at most (one backward per micro-batch): under ZeRO-3 the search has pp 1 only
    with pytest.raises(LmforgeError, match=r"use train.parallel=zero1 \(shards each stage's optimizer states\) or ddp"):
        fits("train.parallel=zero3", "parallel.pp=2", dp=8)
    for dp, tp in itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8]):
        if dp * tp < st["devices"]:
            assert not fits("train.parallel=zero3", f"parallel.tp={tp}", dp=dp)
    # without ZeRO, pipeline stages are how the fewest devices hold it
    plan, out = solved([item for item in args if item not in ("--zero-stage", "3")], capsys)
    st = plan["setup"]
    assert plan["memory"]["fits"] and st["pp"] > 1 and st["zero_stage"] == 0
    for tp, pp in itertools.product([1, 2, 4, 8], [1, 2, 4, 5, 8, 10, 16, 20, 40, 80]):  # without ZeRO dp saves nothing
        if tp * pp < st["devices"]:
            assert not fits(f"parallel.tp={tp}", f"parallel.pp={pp}")
    # serving: the fewest tensor-parallel devices that hold bf16 Llama-3-70B's weights and one 4k context
    plan, out = solved(["plan", "--inference", "--model", "llama3-70b", "--seq-len", "4096", "--hardware", "h100-sxm",
                        "--solve", "devices"], capsys)
    assert plan["setup"]["tp"] == 2 and plan["memory"]["fits"]
