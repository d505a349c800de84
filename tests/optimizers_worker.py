"""Run by tests/test_optimizers_dist.py under torchrun (not a test module itself): trains the
`tiny` model a few steps with each run's overrides (an optimizer under a strategy), every rank on
its rows of one global batch (parallel_worker's batches and loop), and rank 0 saves the full state
by name, the losses and the last step's bytes sent by kind. A run's strategy "pipeline" is
tests/pipeline_compose_worker.py's run of its overrides (stages, replicas, the plan's bytes, the
state's round trip) in this same launch."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

from parallel_worker import config, train
from pipeline_compose_worker import train_and_measure

from lmforge.modes import get_policy
from lmforge.train.setup import build_engine

STEPS, ACCUM = 3, 2


def data_parallel_run(strategy: str, overrides: list[str]) -> dict:
    cfg = config(strategy, "fp32", ACCUM, overrides)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    losses, norms = train(engine, cfg, STEPS, dist.get_rank(), dist.get_world_size())  # resets comm at the last step
    sent = {kind: engine.comm.sent_bytes(kind) for kind in ("model", "optimizer")}
    state = engine.optimizer_state_dict()
    # a fresh engine loads the state back by name (ZeRO: each rank its shard of the full tensors)
    fresh = build_engine(cfg, get_policy(cfg.train.precision))
    fresh.load_model_state_dict({k: v.clone() for k, v in engine.model_state_dict().items()})
    fresh.load_optimizer_state_dict(copy.deepcopy(state))
    return dict(model=engine.model_state_dict(), losses=losses, norms=norms, sent=sent,
                optimizer=type(engine.optimizer).__name__, state=state, reloaded=fresh.optimizer_state_dict())


def main(out: str, runs: str):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for key, (strategy, overrides) in json.loads(runs).items():
        results[key] = (train_and_measure(overrides) if strategy == "pipeline"
                        else data_parallel_run(strategy, overrides))
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
