"""Elementwise rates for the roof (roofline.py's Roof, measured by measure.measure_roof):
bytes/s of one operator of each family of roofline.FAMILIES by call size, each call timed after
other writes have pushed its operands out of cache (or, measure_elementwise_after, after W bytes
of them, W up to the cache's size), and the size of the cache itself."""

import time
from pathlib import Path

import torch

from lmforge.accounting.hardware import _sync

ELEMENTWISE_SIZES = (2**12, 2**16, 2**20, 2**23)  # fp32 elements of each operand of an add
EVICT_MIB = 128  # written before each timed elementwise call at least (cold_writes): a GPU's L2, most CPUs' last level


def cold_writes(cache: float) -> float:
    """Bytes of other writes after which an operand is out of cache: the last level's size, and at
    least EVICT_MIB. On the 2-core Intel VM, whose last level Linux reports as 480 MiB, calls timed
    after 128 MiB of writes ran 1.2-1.9x faster than after 512 MiB (after 768 MiB and 1 GiB as after
    512): a fixed 128 MiB priced GPT-2's step, which writes gigabytes, warmer than it runs."""
    return max(float(EVICT_MIB * 2**20), cache)


def _cold_rate(op, work: float, device: torch.device, runs: int = 9, evict_bytes: float = EVICT_MIB * 2**20) -> float:
    """Best `work` units per second of single calls of `op`, each timed after `evict_bytes` of writes
    (by default enough to push its operands out of cache). In a training step an elementwise
    operator's operands were last touched many operators before (the backward reads what the
    forward saved, the optimizer each state once a step), so they come from memory: the same
    operands timed again and again stay in cache and run faster (on the EPYC, a 1 MiB multiply
    warm 34 us, cold 154 us; at ~5 MB a call the model's multiplies ran at a third of the warm
    rate, bench/step_time.py). The best of 9: of 3, four roofs measured one after another on the
    2-core Intel VM priced tiny's norms/elementwise at 4.40-4.92 ms, of 9 at 3.87-3.98 ms."""
    evict = torch.empty(int(evict_bytes) // 4, device=device)
    op()
    best = float("inf")
    for _ in range(runs):
        evict.fill_(1.0)
        _sync(device)
        started = time.perf_counter()
        op()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return work / best


def _family_calls(n: int, device: torch.device) -> dict:
    """{family: (the call, bytes it moves)} of one representative operator of each family of
    roofline.FAMILIES on n fp32 elements, bytes counted as ops counts them."""
    x, y = torch.ones(n, device=device), torch.ones(n, device=device)
    rows = x.view(-1, 64)
    return {
        "binary": (lambda: x * y, 3 * 4 * n),
        "binary_inplace": (lambda: x.mul_(y), 3 * 4 * n),  # ones times ones: x stays ones
        "unary": (lambda: torch.rsqrt(x), 2 * 4 * n),
        "copy": (lambda: x.to(torch.bfloat16), 4 * n + 2 * n),
        "reduce": (lambda: rows.mean(-1, keepdim=True), 4 * n + 4 * n // 64),
        "vector_norm": (lambda: torch.linalg.vector_norm(x), 4 * n + 4),
        "softmax": (lambda: torch.log_softmax(rows, -1), 2 * 4 * n),
    }


def measure_elementwise_ops(device: torch.device, evict_bytes: float = EVICT_MIB * 2**20) -> dict:
    """{family: [[bytes per call, bytes/s]]} of each family's representative at ELEMENTWISE_SIZES,
    each call after `evict_bytes` of other writes (by default: operands out of cache) (an RMSNorm's
    mean runs at another rate than an add; a cast at its own)."""
    grid = {}
    for n in ELEMENTWISE_SIZES:
        for family, (call, nbytes) in _family_calls(n, device).items():
            grid.setdefault(family, []).append([nbytes, _cold_rate(call, nbytes, device, evict_bytes=evict_bytes)])
    return grid


# the bytes of other writes each call of measure_elementwise_after follows: as fractions of the
# last-level cache, and below them writes that a core's own caches hold (64 KiB: L1 and L2; 2 MiB:
# about one core's L2), where a decode step's few hundred kB of writes fall (bench/decode_time.py:
# priced after a sixteenth of a 480 MiB last level, small's batch-8 decode came out at 0.72 of the
# measured tokens/s, after these at 0.91)
AFTER_CACHE_FRACTIONS = (1 / 16, 1 / 4, 1 / 2, 3 / 4, 1)
AFTER_PRIVATE_BYTES = (2.0**16, 2.0**21)


def after_writes(cache: float) -> list[float]:
    """The Ws of measure_elementwise_after, rising: AFTER_PRIVATE_BYTES, then cache x each of
    AFTER_CACHE_FRACTIONS, those below cold_writes(cache) (the cold grid's W) and each once."""
    evict = cold_writes(cache)
    return sorted({w for w in (*AFTER_PRIVATE_BYTES, *(cache * f for f in AFTER_CACHE_FRACTIONS)) if w < evict})


def measure_elementwise_after(device: torch.device, cold: dict, cache: float) -> dict:
    """{family: [[bytes per call, W, bytes/s]]}: measure_elementwise_ops after W bytes of other
    writes, W each of after_writes(`cache`) (`cache`: the last-level cache), and the cold grid
    `cold` (measured after cold_writes(cache)) as the row of the largest W; {} where the cache is unknown.
    A step that writes less than the cache does not find its operands where a loop repeating one
    call keeps them (L1, L2): what it wrote since an operand was last touched has pushed part of
    it out of a cache that is shared, a victim of L2 and set-associative (on the EPYC, tiny's step
    writes 28 MiB of its 32 MiB L3; one thread, loaded machine: priced at warm rates it came out
    0.6-0.66 of the measured, at cold ones 1.6, after 16-24 MiB of writes 0.91-0.95). The curve
    between is the machine's, measured here; ops.step_roof reads it at the step's writes."""
    evict = cold_writes(cache)
    if not cache:
        return {}
    grid = {}
    for w in after_writes(cache):
        for family, rows in measure_elementwise_ops(device, w).items():
            grid.setdefault(family, []).extend([nbytes, w, rate] for nbytes, rate in rows)
    for family, rows in cold.items():
        grid.setdefault(family, []).extend([nbytes, evict, rate] for nbytes, rate in rows)
    return grid


def cache_bytes(device: torch.device) -> float:
    """The cache an operand can stay in between operators: a GPU's L2, a CPU's last level (as
    Linux reports it for CPU 0), 0 where unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).L2_cache_size)
    sizes = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return float(max(sizes, default=0))
