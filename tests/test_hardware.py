"""The measured matmul peak (lmforge/accounting/hardware.py): how it is measured and cached."""

import json
import os
import subprocess
import sys
from datetime import datetime, timezone

from lmforge.accounting import hardware


def plan_peak(cache_home, *flags) -> float:
    result = subprocess.run([sys.executable, "-m", "lmforge", "plan", "--model", "tiny", "--hardware", "this",
                             "--json", *flags], capture_output=True, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["time"]["peak_flops_per_device"]


def test_the_cached_peak_says_when_and_under_what_load_and_remeasure_replaces_it(tmp_path):
    path = tmp_path / "lmforge" / "matmul_peak.json"
    # the session's cache without its fp32 peak: the plan measures the peak (the roofline only with
    # --roofline: a plain plan neither measures nor reads a roof)
    path.parent.mkdir()
    session = hardware.cache_path()
    cache = json.loads(session.read_text()) if session.exists() else {}
    path.write_text(json.dumps({k: e for k, e in cache.items() if "|torch.float32|" not in k}))
    before = datetime.now(timezone.utc).replace(microsecond=0)
    measured = plan_peak(tmp_path)
    # the matmul peak's entry (the cache also holds the roofline's: accounting/roofline/measure.py)
    (key, entry), = [(k, e) for k, e in json.loads(path.read_text()).items()
                     if k.endswith(f"|torch.float32|torch {hardware.torch.__version__}")]
    assert entry["flops"] == measured > 1e6
    assert datetime.fromisoformat(entry["measured_at"]) >= before
    assert len(entry["load_average_1_5_15_min"]) == 3 and entry["cpus"] == os.cpu_count()

    # a wrong peak measured on an idle machine: kept until remeasured (any roof's entry kept too:
    # measured again, it would cost the next `plan --roofline` half a minute)
    entry["flops"], entry["load_average_1_5_15_min"] = 1.0, [0.0, 0.0, 0.0]
    path.write_text(json.dumps({**json.loads(path.read_text()), key: entry}))
    assert plan_peak(tmp_path) == 1.0
    assert plan_peak(tmp_path, "--remeasure") > 1e6
    assert json.loads(path.read_text())[key]["flops"] > 1e6


def test_a_bare_number_from_an_older_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype, device: 123.0)
    key = f"{hardware.device_name(hardware.torch.device('cpu'))}|torch.float32|torch {hardware.torch.__version__}"
    hardware.cache_path().parent.mkdir(parents=True)
    hardware.cache_path().write_text(json.dumps({key: 54e9}))  # no date, no load: cannot be judged
    assert hardware.matmul_peak() == 123.0
    assert json.loads(hardware.cache_path().read_text())[key]["flops"] == 123.0


def test_a_peak_measured_on_a_busier_machine_is_measured_again(tmp_path, monkeypatch):
    """The cache records the load it was measured under: taken while the machine was busier by a
    whole CPU than it is now, it is measured again (and replaced); under a similar load it stays."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype, device: 123.0)
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (0.4, 0.5, 0.5))
    key = f"{hardware.device_name(hardware.torch.device('cpu'))}|torch.float32|torch {hardware.torch.__version__}"
    hardware.cache_path().parent.mkdir(parents=True)
    for load, expected in (([1.3, 1.0, 1.0], 54e9), ([1.5, 1.0, 1.0], 123.0)):
        entry = {"flops": 54e9, "measured_at": "2026-11-30T20:00:00+00:00", "load_average_1_5_15_min": load, "cpus": 2}
        hardware.cache_path().write_text(json.dumps({key: entry}))
        assert hardware.matmul_peak() == expected
    assert json.loads(hardware.cache_path().read_text())[key]["load_average_1_5_15_min"] == [0.4, 0.5, 0.5]


def test_the_peak_is_the_best_of_several_timings(monkeypatch):
    """Timings slowed by other work on the machine do not lower the result. A fake clock advances
    2**-4 s per reading while the machine is busy (the first two timings), then 2**-6 s: the
    peak is that of the idle timings, 4x the busy ones (one reading per matmul, so 2n^3 FLOPs
    per tick)."""
    readings = {"n": 0, "now": 0.0}

    def clock():
        readings["n"] += 1
        readings["now"] += 2.0**-4 if readings["n"] <= 10 else 2.0**-6  # a timing: 1 + 4 readings while busy
        return readings["now"]

    monkeypatch.setattr(hardware.time, "perf_counter", clock)
    peak = hardware.measure_matmul_peak(hardware.torch.float32, "cpu", sizes=(64,), runs=5, seconds=0.25)
    assert peak == 2 * 64**3 * 2.0**6
    assert readings["n"] == 2 * 5 + 3 * 17  # five timings: two busy (4 matmuls each), three idle (16 each)
