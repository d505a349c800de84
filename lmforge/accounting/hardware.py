"""The machine's measured matmul peak: the denominator of MFU on hardware with no datasheet entry.

The peak is the best FLOP/s of large square matmuls (2*n^3 FLOPs each) in the given dtype,
measured once per machine, torch version and thread count and cached in the user's cache dir.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lmforge" / "matmul_peak.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        sizes: tuple[int, ...] = (1024, 2048), seconds: float = 0.5) -> float:
    """Best achieved FLOP/s over square matmuls of the given sizes."""
    device = torch.device(device)
    best = 0.0
    generator = torch.Generator(device).manual_seed(0)  # leave the global RNG to the training run
    for n in sizes:
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        a @ b  # warm-up: allocation, kernel selection
        _sync(device)
        reps, elapsed = 0, 0.0
        started = time.perf_counter()
        while elapsed < seconds:
            a @ b
            _sync(device)
            reps += 1
            elapsed = time.perf_counter() - started
        best = max(best, 2 * n**3 * reps / elapsed)
    return best


def matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> float:
    """Measured peak FLOP/s for this machine and dtype, from the cache when measured before."""
    device = torch.device(device)
    key = f"{device_name(device)}|{dtype}|torch {torch.__version__}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_peak(dtype, device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=2))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home still gets the number, just not cached
    return cache[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
