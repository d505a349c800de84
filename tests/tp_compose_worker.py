"""Run by tests/test_tp_compose_dist.py under torchrun (not a test module itself): tensor-parallel
cells (parallel.tp=2, world / 2 replicas under ddp) each trained STEPS steps of parallel_worker's
global batches; rank 0 saves, per cell, the losses, gradient norms, the last step's trainable
gradients gathered by name and the final state (full tensors by name).

    argv: OUT RUNS   RUNS: JSON {cell name: [config overrides]}
"""

import datetime
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from parallel_worker import train  # noqa: E402
from tp_worker import STEPS, tp_config  # noqa: E402

from lmforge.modes import get_policy  # noqa: E402
from lmforge.parallel.tp import shard_copies, sharded_dim  # noqa: E402
from lmforge.parallel.tp_engine import gather_full  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

TP = 2


def trainable_grads(model, tp_comm) -> dict[str, torch.Tensor]:
    """The trainable parameters' gradients by canonical name, whole (sharded ones all-gathered)."""
    names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}  # tied: the last name
    return {names[id(p)]: p.grad.float().clone() if tp_comm is None or sharded_dim(p) is None
            else gather_full(p.grad.float(), sharded_dim(p), tp_comm, shard_copies(p))
            for p in dict.fromkeys(model.parameters()) if p.grad is not None}


def run_cell(overrides: list[str]) -> dict:
    cfg = tp_config(TP, dist.get_world_size(), overrides)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    held = {}
    losses, norms = train(engine, cfg, STEPS, engine.replica, engine.replicas,
                          on_grads=lambda e: held.update(grads=trainable_grads(e.model, e.tp_comm)))
    return dict(losses=losses, norms=norms, model={k: v.float() for k, v in engine.model_state_dict().items()},
                **held)


def main(out: str, runs: dict[str, list[str]]):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, overrides in runs.items():
        results[name] = run_cell(overrides)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
