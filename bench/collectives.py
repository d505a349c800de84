"""Latency and bandwidth of the collectives on a launched process group, for the roofline's
communication class (lmforge/accounting/roofline/__init__.py's Roof.collective, which `lmforge plan`
leaves empty: its collectives are priced only where measured here). Used by bench/step_time_dist.py
and tests/roofline_dist_worker.py, under torchrun: every rank calls measure_collective.
"""

import time

import torch
import torch.distributed as dist


def measure_collective(group=None, sizes: tuple[int, ...] = (2**2, 2**19), repeats: int = 21) -> dict:
    """Latency and bandwidth of all-reduce, reduce-scatter and all-gather on the launched process
    group (every rank calls it), fitted t = latency + bytes / bandwidth through the median time of
    `repeats` calls at the smallest and the largest of `sizes` (fp32 elements of the full tensor),
    bytes counted as parallel/comm.py counts them (a ring sends 2 (N-1)/N of an all-reduced
    tensor per rank, (N-1)/N of a reduce-scattered or all-gathered one). The median, not the best:
    in a step the ranks do not reach a collective together, and one started during backward on a
    core that computes pays about its median (2 CPU ranks, gloo: a 16-byte all-reduce's best 127 us,
    median 254 us, 291 us during a matmul loop). The top level keeps all-reduce's figures."""
    ranks = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    calls = {
        "all_reduce": (2, lambda full, shard: dist.all_reduce(full, group=group)),
        "reduce_scatter": (1, lambda full, shard: dist.reduce_scatter_single(shard, full, group=group)),
        "all_gather": (1, lambda full, shard: dist.all_gather_single(full, shard, group=group)),
    }
    operators = {}
    for operator, (passes, call) in calls.items():
        points = []
        for n in sizes:
            full = torch.ones(n * ranks, device=device)  # a multiple of the ranks: the shards are whole
            shard = torch.ones(n, device=device)
            # warm-up: connection set-up (with one, a 16 B all-reduce's median of 9 once read 3.2 ms, 10x its usual)
            for _ in range(3):
                call(full, shard)
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                started = time.perf_counter()
                call(full, shard)
                if nccl:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - started)
            points.append((passes * (ranks - 1) / ranks * full.nbytes, sorted(times)[repeats // 2]))
        (b0, t0), (b1, t1) = points[0], points[-1]
        bandwidth = (b1 - b0) / (t1 - t0) if t1 > t0 else b1 / t1
        operators[operator] = {"latency_s": max(t0 - b0 / bandwidth, 0.0), "bytes_per_second": bandwidth}
    return {**operators["all_reduce"], "operators": operators, "ranks": ranks,
            "backend": str(dist.get_backend(group))}
