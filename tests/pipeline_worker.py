"""Run by tests/test_pipeline.py under torchrun (not a test module itself): trains a small model a
few steps on pipelines given as override lists, every replica on its rows of one global batch, and
rank 0 saves what the test compares: the whole model's state by name (gathered from the stages),
losses, gradient norms, each rank's micro-batches and activation bytes in flight."""

import datetime
import json
import sys

import torch
import torch.distributed as dist

from parallel_worker import SEQ, global_batches

from lmforge.config import make_config
from lmforge.precision.policy import LossScaler
from lmforge.modes import get_policy
from lmforge.train.loop import train_step
from lmforge.train.setup import build_engine

ROWS, STEPS = 2, 3  # rows (of SEQ tokens) per replica per micro-batch; optimizer steps


def config(overrides):
    return make_config("tiny", overrides=[f"train.seq_len={SEQ}", f"train.batch_size={ROWS}", "optim.lr=3e-3",
                                          *overrides])


def micro_batches(step: int, count: int, rows: int, vocab: int, prompts: bool = False):
    """The step's `count` micro-batches of `rows` rows (the same on every rank); with `prompts`
    (a fine-tune) each row's first tokens have no targets (parallel_worker.py's, the same tokens)."""
    return global_batches(step, count, rows, vocab, prompts)


def train(engine, cfg, count: int, replica: int, replicas: int, rows: int = ROWS):
    """STEPS optimizer steps of `count` micro-batches each (train.micro_batches on a pipeline,
    train.grad_accum in one process); replica r takes rows r*rows:(r+1)*rows of each."""
    policy = get_policy(cfg.train.precision)
    scaler = LossScaler(enabled=policy.loss_scaling)
    losses, norms = [], []
    for step in range(STEPS):
        batches = iter([(x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows])
                        for x, y in micro_batches(step, count, replicas * rows, cfg.model.vocab_size,
                                                  prompts=cfg.finetune.base is not None)])
        loss, norm, _ = train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr,
                                   cfg.optim.grad_clip, scaler, policy, torch.device("cpu"))
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def main(out: str, runs: str):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for key, overrides in json.loads(runs).items():
        cfg = config(overrides)
        torch.manual_seed(cfg.train.seed)
        engine = build_engine(cfg, get_policy(cfg.train.precision))
        losses, norms = train(engine, cfg, cfg.train.micro_batches, engine.replica, engine.replicas)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {"stage": engine.layout.stage, "replica": engine.replica,
                                       "model": engine.model_state_dict(), "in_flight": engine.in_flight})
        whole = {}
        for part in parts:
            whole.update(part["model"] if part["replica"] == 0 else {})
        results[key] = dict(model=whole, losses=losses, norms=norms, optimizer_groups=engine.optimizer_state_dict()[
            "param_groups"], in_flight={(p["replica"], p["stage"]): p["in_flight"] for p in parts},
                            replicas_equal=all(torch.equal(part["model"][k], whole[k]) for part in parts
                                               for k in part["model"]))
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
