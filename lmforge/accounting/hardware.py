"""Peak FLOP/s (the denominator of MFU), memory bandwidth and memory: from vendor datasheets, or
measured on the machine at hand.

MFU = achieved model FLOP/s / peak FLOP/s (Chowdhery et al. 2022, appendix B), where model FLOP/s
counts the analytical training FLOPs (accounting/shapes.py) and not recomputation; HFU counts the
FLOPs the hardware really ran, recomputation included.

Datasheet peaks are dense (no 2:4 sparsity), in FLOP/s, for the dtype of the matmul inputs with
fp32 accumulation where the vendor lists both. The measured peak is the best FLOP/s of large
square matmuls (2*n^3 FLOPs each) in the given dtype over several short timings, so that a
moment when other work shares the machine lowers some timings but not the best one. It is
measured once per machine, torch version and thread count and cached in the user's cache dir
with when it was measured and the load average then (os.getloadavg); measured on a busy
machine it is too low in every later MFU: `lmforge plan --hardware this --remeasure` replaces it.
Memory bandwidth (what bounds decoding: accounting/plan/inference.py) is measured and cached the same
way, as the best bytes/s of a large matrix-vector product.
"""

import json
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

TERA = 1e12
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int  # as the device reports it (nvidia-smi's memory.total, rocm-smi's VRAM total)
    peak_flops: dict[str, float]  # keyed by "float32" (non-tensor-core), "tf32", "bfloat16", "float16", "float8"
    memory_bandwidth: float  # bytes/s, datasheet
    source: str


# Each entry cites the vendor document its peaks and bandwidth come from. Memory is what the device
# reports, not the marketing "80 GB" (80e9 bytes would be 74.5 GiB): nvidia-smi's memory.total in
# MiB as it prints it on that part (A100 80GB 81920 MiB = 80.0 GiB; H100 80GB 81559 MiB = 79.6
# GiB), rocm-smi's "VRAM Total Memory (B)" for the MI300X. PyTorch's total_memory on the same part
# is a little lower again, and the CUDA context takes its share: the plan's reserve covers both.
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in [
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM 80GB column: FP32 19.5, TF32 156, BF16/FP16
    # 312 TFLOPS; 2,039 GB/s HBM2e.
    Accelerator("a100", 81920 * MIB, {"float32": 19.5 * TERA, "tf32": 156 * TERA, "bfloat16": 312 * TERA,
                                      "float16": 312 * TERA}, 2039e9, "NVIDIA A100 datasheet, SXM 80GB"),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column; the datasheet's tensor figures are
    # "with sparsity", halved here: TF32 494.7, BF16/FP16 989.4, FP8 1978.9 TFLOPS dense; FP32 67;
    # 3.35 TB/s HBM3.
    Accelerator("h100-sxm", 81559 * MIB, {"float32": 67 * TERA, "tf32": 494.7 * TERA, "bfloat16": 989.4 * TERA,
                                          "float16": 989.4 * TERA, "float8": 1978.9 * TERA}, 3.35e12,
                "NVIDIA H100 datasheet, SXM"),
    # Same datasheet, PCIe column: FP32 51, TF32 378, BF16/FP16 756, FP8 1513 TFLOPS dense; 2 TB/s.
    Accelerator("h100-pcie", 81559 * MIB, {"float32": 51 * TERA, "tf32": 378 * TERA, "bfloat16": 756 * TERA,
                                           "float16": 756 * TERA, "float8": 1513 * TERA}, 2.0e12,
                "NVIDIA H100 datasheet, PCIe"),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: the H100 SXM's compute with 141 GB HBM3e
    # at 4.8 TB/s (nvidia-smi: 143771 MiB).
    Accelerator("h200", 143771 * MIB, {"float32": 67 * TERA, "tf32": 494.7 * TERA, "bfloat16": 989.4 * TERA,
                                       "float16": 989.4 * TERA, "float8": 1978.9 * TERA}, 4.8e12,
                "NVIDIA H200 datasheet, SXM"),
    # NVIDIA HGX B200 datasheet (2024), per GPU, dense: FP32 75, TF32 1100, BF16/FP16 2250, FP8 4500
    # TFLOPS; 64 TB/s over 8 GPUs: 8 TB/s each (nvidia-smi: 183359 MiB).
    Accelerator("b200", 183359 * MIB, {"float32": 75 * TERA, "tf32": 1100 * TERA, "bfloat16": 2250 * TERA,
                                       "float16": 2250 * TERA, "float8": 4500 * TERA}, 8e12,
                "NVIDIA HGX B200 datasheet, per GPU"),
    # NVIDIA L4 datasheet (2023): FP32 30.3; tensor figures with sparsity halved: TF32 60,
    # BF16/FP16 121, FP8 242.5 TFLOPS dense; 300 GB/s GDDR6 (nvidia-smi: 23034 MiB).
    Accelerator("l4", 23034 * MIB, {"float32": 30.3 * TERA, "tf32": 60 * TERA, "bfloat16": 121 * TERA,
                                    "float16": 121 * TERA, "float8": 242.5 * TERA}, 300e9, "NVIDIA L4 datasheet"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 column: FP32 82.6; with FP32
    # accumulate, dense: TF32 82.6, BF16/FP16 165.2, FP8 330.3 TFLOPS; 1,008 GB/s GDDR6X
    # (nvidia-smi: 24564 MiB).
    Accelerator("rtx4090", 24564 * MIB, {"float32": 82.6 * TERA, "tf32": 82.6 * TERA, "bfloat16": 165.2 * TERA,
                                         "float16": 165.2 * TERA, "float8": 330.3 * TERA}, 1008e9,
                "NVIDIA Ada Lovelace whitepaper, RTX 4090"),
    # AMD Instinct MI300X datasheet (2023), dense: FP32 163.4, TF32 653.7, BF16/FP16 1307.4, FP8
    # 2614.9 TFLOPS; 5.3 TB/s HBM3 (rocm-smi: 205822885888 bytes, 191.7 GiB).
    Accelerator("mi300x", 205822885888, {"float32": 163.4 * TERA, "tf32": 653.7 * TERA, "bfloat16": 1307.4 * TERA,
                                         "float16": 1307.4 * TERA, "float8": 2614.9 * TERA}, 5.3e12,
                "AMD Instinct MI300X datasheet"),
]}

# Memory a plan keeps free beside what it counts: the CUDA context (a few hundred MiB), the gap
# between what nvidia-smi reports and what PyTorch may allocate, and the caching allocator's
# fragmentation. A round allowance, not a measurement: `--reserve` sets it (on a GPU,
# torch.cuda.mem_get_info() after the first allocation shows what the context took).
DEFAULT_RESERVE_BYTES = 2 * GIB


def accelerator_peak(name: str, dtype: str) -> float:
    """Datasheet peak FLOP/s of `name` for matmuls in `dtype`."""
    check_hardware(name)
    peaks = ACCELERATORS[name].peak_flops
    if dtype not in peaks:
        raise ValueError(f"{name} has no {dtype} matmul peak on its datasheet (it has: {', '.join(peaks)})")
    return peaks[dtype]


def hardware_figures(name: str, dtype: str, this_machine: tuple | None) -> tuple:
    """(name, peak FLOP/s of matmuls in `dtype`, memory bytes, memory bandwidth) of a named accelerator,
    from its datasheet; for "this", `this_machine` as the caller measured it (accounting stays pure:
    a training plan's holds no bandwidth, an inference plan's does)."""
    if name == "this":
        if this_machine is None:
            raise ValueError("hardware 'this' needs the measured (name, peak FLOP/s, memory bytes[, bandwidth])")
        return this_machine
    return name, accelerator_peak(name, dtype), ACCELERATORS[name].memory_bytes, ACCELERATORS[name].memory_bandwidth


def check_hardware(name: str) -> None:
    """ValueError unless `name` is "this" (the machine at hand, measured) or a known accelerator."""
    if name != "this" and name not in ACCELERATORS:
        raise ValueError(f"unknown hardware {name!r}; known: this, {', '.join(ACCELERATORS)}")


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, appendix B); with hardware FLOPs per token
    (recomputation counted) the same ratio is HFU."""
    return tokens_per_second * flops_per_token / peak_flops


def host_memory_bytes() -> int:
    """Total RAM of this machine (the 'memory' of a CPU device)."""
    line = _proc_line("/proc/meminfo", "MemTotal:")
    return int(line.split()[1]) * 1024 if line else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _proc_line(path: str, prefix: str) -> str | None:
    """The first line of a /proc file that starts with `prefix` (None: no such line, or no such file)."""
    try:
        return next((line for line in Path(path).read_text().splitlines() if line.startswith(prefix)), None)
    except OSError:
        return None


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lmforge" / "matmul_peak.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    line = _proc_line("/proc/cpuinfo", "model name")
    cpu = line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} threads"


def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        sizes: tuple[int, ...] = (1024, 2048), runs: int = 3, seconds: float = 0.1) -> float:
    """Best achieved FLOP/s over `runs` timings of about `seconds` each, per square matmul size: about
    a second on a 2-core CPU, paid once (the cache keeps it) before a run's first step."""
    device = torch.device(device)
    best = 0.0
    generator = torch.Generator(device).manual_seed(0)  # leave the global RNG to the training run
    for n in sorted(sizes):
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        a @ b  # warm-up: allocation, kernel selection
        _sync(device)
        for _ in range(runs):
            per_second, per_call = _calls_per_second(lambda: a @ b, device, seconds)
            best = max(best, 2 * n**3 * per_second)
            if per_call > seconds * runs / 2:
                break  # one matmul takes half the budget: a dtype with no fast path here (fp16 on most CPUs)
        if per_call > seconds:
            break  # twice the size (8x the work) would take seconds a call: a dtype with no fast path here
    return best


def measure_memory_bandwidth(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                             megabytes: int = 256, runs: int = 5, seconds: float = 0.1) -> float:
    """Best bytes/s of a matrix-vector product over a `megabytes` MiB matrix (far beyond any cache):
    decoding's own operation, which reads each weight once per token and does 2 FLOPs with it."""
    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    rows = megabytes * MIB // element // 4096
    matrix = torch.full((rows, 4096), 0.5, dtype=dtype, device=device)
    vector = torch.full((4096,), 0.5, dtype=dtype, device=device)
    matrix @ vector  # warm-up
    _sync(device)
    return max(matrix.nbytes * _calls_per_second(lambda: matrix @ vector, device, seconds)[0] for _ in range(runs))


def _calls_per_second(op, device: torch.device, seconds: float) -> tuple[float, float]:
    """(calls of `op` per second, seconds per call), timed over about `seconds`, the device synced after each."""
    reps, elapsed = 0, 0.0
    started = time.perf_counter()
    while elapsed < seconds:
        op()
        _sync(device)
        reps += 1
        elapsed = time.perf_counter() - started
    return reps / elapsed, elapsed / reps


def matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                remeasure: bool = False, store: bool = True) -> float:
    """Measured peak FLOP/s for this machine and dtype, from the cache when measured before
    (unless `remeasure`). A cache entry records when and under what load it was measured; a new
    measurement is written to the cache only with `store` (the CLI's choice, not a library's)."""
    device = torch.device(device)
    key = f"{device_name(device)}|{dtype}|torch {torch.__version__}"
    return _measured(key, "flops", lambda: measure_matmul_peak(dtype, device), remeasure, store)


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: concurrent writers
        tmp.write_text(json.dumps(cache, indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still gets the number, just not cached


def cached_field(key: str, field: str):
    """The cache's `field` of the entry `key`, or None."""
    entry = _read_cache().get(key)
    return entry.get(field) if isinstance(entry, dict) else None


def store_field(key: str, field: str, value) -> None:
    """Set `field` of the cache's existing entry `key` (one measured alongside it, e.g. the rates of
    a model's matmul shapes beside the roof they refine); no entry, nothing stored."""
    cache = _read_cache()
    if isinstance(cache.get(key), dict):
        cache[key][field] = value
        _write_cache(cache)


def _measured(key: str, field: str, measure, remeasure: bool, store: bool) -> float:
    """`measure()`'s result for `key`, from the cache unless `remeasure`, or stale (see _busier_then).
    A new measurement replaces the whole entry, the fields stored beside it (store_field) with it."""
    cache = _read_cache()
    entry = cache.get(key)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if remeasure or not isinstance(entry, dict) or field not in entry or _busier_then(entry, load):
        # a bare number (older caches) says nothing of its load; one measured while the machine was
        # busier than it is now (a load average higher by a whole CPU) undercounts the peak
        entry = cache[key] = {field: measure(),
                              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "load_average_1_5_15_min": load, "cpus": os.cpu_count()}
        if store:
            _write_cache(cache)
    return entry[field]


def _busier_then(entry: dict, load_now) -> bool:
    """Whether a cached measurement was taken under a 1-minute load average at least one CPU's
    worth above the current one."""
    then = entry.get("load_average_1_5_15_min")
    return bool(then and load_now and then[0] >= load_now[0] + 1.0)


# The matmul timed for a matmul dtype's peak on this machine. fp8 matmuls (`torch._scaled_mm`)
# need scales and run on few devices, so they are not timed: the bf16 peak stands in for them.
TIMED_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8": torch.bfloat16}


def this_device(matmul_dtype: str, device: torch.device, remeasure: bool = False,
                store: bool = True) -> tuple[str, float, int]:
    """(name, measured peak FLOP/s for `matmul_dtype`, memory bytes) of `device`, as a plan wants it;
    `remeasure` replaces the cached peak, `store` writes a new measurement to the cache."""
    timed = TIMED_DTYPE[matmul_dtype]
    name = device_name(device)
    if str(timed).removeprefix("torch.") != matmul_dtype:
        name += f" ({str(timed).removeprefix('torch.')} peak standing in for {matmul_dtype})"
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory_bytes()
    return name, matmul_peak(timed, device, remeasure, store), memory


def this_bandwidth(dtype: str, device: torch.device, remeasure: bool = False, store: bool = True) -> float:
    """Measured memory bandwidth of `device` (bytes/s) reading `dtype` weights ("float32", "bfloat16",
    "float16"; a quantised format's bytes are read at the bandwidth of bfloat16's), cached as the
    matmul peak is."""
    timed = TIMED_DTYPE.get(dtype, torch.bfloat16)  # a matmul dtype's timed one (fp8: bf16), else bf16
    key = f"memory bandwidth|{device_name(device)}|{timed}|torch {torch.__version__}"
    return _measured(key, "bytes_per_second", lambda: measure_memory_bandwidth(timed, device), remeasure, store)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
