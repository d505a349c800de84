"""Run by tests/test_optimizers_dist.py under torchrun (not a test module itself): trains the
`tiny` model a few steps with each run's overrides (an optimizer under a strategy), every rank on
its rows of one global batch (parallel_worker's batches and loop), and rank 0 saves the full state
by name and the losses."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

from parallel_worker import config, train

from lmforge.modes.precision import get_policy
from lmforge.train.setup import build_engine

STEPS, ACCUM = 3, 2


def main(out: str, runs: str):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for key, (strategy, overrides) in json.loads(runs).items():
        cfg = config(strategy, "fp32", ACCUM, overrides)
        torch.manual_seed(cfg.train.seed)
        engine = build_engine(cfg, get_policy(cfg.train.precision))
        losses, norms = train(engine, cfg, STEPS, rank, ranks)
        state = engine.optimizer_state_dict()
        # a fresh engine loads the state back by name (ZeRO: each rank its shard of the full tensors)
        fresh = build_engine(cfg, get_policy(cfg.train.precision))
        fresh.load_model_state_dict({k: v.clone() for k, v in engine.model_state_dict().items()})
        fresh.load_optimizer_state_dict(copy.deepcopy(state))
        results[key] = dict(model=engine.model_state_dict(), losses=losses, norms=norms,
                            optimizer=type(engine.optimizer).__name__, state=state,
                            reloaded=fresh.optimizer_state_dict())
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
