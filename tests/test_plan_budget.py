"""Memory headroom (device memory as reported, a reserve on its own line) and the training budget."""

import json

import pytest

from lmforge.accounting.hardware import ACCELERATORS
from lmforge.accounting.memory import parameter_count
from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.cli import main
from lmforge.config import make_config


def test_device_memory_is_what_the_device_reports_not_the_marketing_gigabytes():
    # nvidia-smi memory.total: A100 80GB 81920 MiB, H100 80GB 81559 MiB; "80 GB" would be 74.5 GiB
    assert ACCELERATORS["a100"].memory_bytes == 81920 * 2**20
    assert ACCELERATORS["h100-sxm"].memory_bytes == ACCELERATORS["h100-pcie"].memory_bytes == 81559 * 2**20
    assert ACCELERATORS["h200"].memory_bytes == 143771 * 2**20
    assert all(a.memory_bandwidth > 0 for a in ACCELERATORS.values())


def test_the_reserve_is_its_own_line_and_decides_what_fits(capsys):
    args = ["plan", "--model", "llama3-1b", "--batch-size", "1", "--seq-len", "1024", "--precision", "bf16-mixed",
            "--hardware", "l4", "--recompute", "full"]
    assert main([*args, "--reserve", "0", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    room = (mem["device_memory_bytes"] - mem["per_device_bytes"]) / 2**30
    assert mem["fits"] and room > 0.5
    assert main([*args, "--reserve", f"{room - 0.25:.3f}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["fits"]
    assert main([*args, "--reserve", f"{room + 0.25:.3f}"]) == 0
    out = capsys.readouterr().out
    assert "reserve (--reserve" in out and "does NOT fit" in out


def test_the_budget_defaults_to_chinchilla_and_costs_flops_over_throughput(capsys):
    run = make_config("llama3-8b", overrides=["train.batch_size=1", "train.seq_len=8192", "train.precision=bf16-mixed",
                                              "train.parallel=zero3", "train.recompute=full"])
    plan = make_plan(run, Costing(dp=8, hardware="h100-sxm", mfu=0.4, price_per_hour=2.5))
    cfg = run.model
    n = parameter_count(cfg)
    assert plan["time"]["tokens"] == 20 * n and "Chinchilla" in plan["time"]["tokens_source"]
    flops = 20 * n * plan["flops"]["training_per_token"]
    assert plan["budget"]["training_flops"] == pytest.approx(flops, rel=1e-12)
    # every device runs at the assumed MFU, so device-hours = FLOPs / (peak * MFU) / 3600
    device_hours = flops / (989.4e12 * 0.4) / 3600
    assert plan["budget"]["device_hours"] == pytest.approx(device_hours, rel=1e-12)
    assert plan["budget"]["cost"] == pytest.approx(2.5 * device_hours, rel=1e-12)
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--precision", "bf16-mixed",
                 "--tokens", "1e12", "--price-per-hour", "2"]) == 0
    out = capsys.readouterr().out
    assert "time for 1.00 T tokens" in out and "Chinchilla" not in out and "cost at 2 per device-hour" in out


def test_a_runs_plan_gives_its_own_steps_time_before_the_budgets(tiny_config, tmp_path, capsys):
    from rich.console import Console

    from lmforge.train.loop import Trainer

    # lmforge train's start-up plan: the run's own 8 steps (minutes for a real run), then Chinchilla's reference
    console = Console(record=True, width=200)
    Trainer(tiny_config(max_steps=8), tmp_path / "run", console=console, progress=False).close()
    printed = console.export_text()
    capsys.readouterr()  # the console printed it too
    tokens_per_step = 4 * 64  # tiny_overrides' batch of 4, the tiny model's 64 positions
    own = f"time for the run's 8 steps ({8 * tokens_per_step / 1e3:.2f} k tokens)"
    assert own in printed and "Chinchilla" in printed
    assert printed.index(own) < printed.index("Chinchilla")
    plan = make_plan(tiny_config(max_steps=8), Costing(hardware="a100", own_steps=True))
    run, t = plan["time"]["run"], plan["time"]
    assert run == {"steps": 8, "tokens": 8 * tokens_per_step, "seconds": pytest.approx(8 * t["seconds_per_step"])}
    # lmforge plan: where it knows the run's steps (given here; a run folder's config.yaml holds them)
    assert main(["plan", "--model", "tiny", "--hardware", "a100", "train.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert out.index("time for the run's 7 steps") < out.index("Chinchilla")
    assert main(["plan", "--model", "tiny", "--hardware", "a100"]) == 0
    assert "the run's" not in capsys.readouterr().out  # a preset alone: no run's steps to time
