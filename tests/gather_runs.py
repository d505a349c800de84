"""The `main` of the multi-rank accounting workers: each named run measured on every rank, the
ranks' results gathered, rank 0 saving {name: [result of rank 0, rank 1, ...]} to `out`."""

import datetime
import json
import sys

import torch
import torch.distributed as dist


def gather_runs(measure) -> None:
    """`measure(name, overrides)` for each run of argv[2] (JSON {name: overrides}); saved to argv[1]."""
    out, runs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, overrides in runs.items():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, measure(name, overrides))
        results[name] = every
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()
