"""Run by tests/test_pipeline_compose_dist.py and tests/test_pipeline_cells_dist.py under torchrun
(not a test module itself): pipelines with LoRA, ZeRO-1 over each stage's replicas, each precision,
full fine-tunes, compile and recomputation, trained a few steps as tests/pipeline_worker.py trains
them; rank 0 saves, per run, the whole model by name (replica 0's stages), the losses and
norms, each rank's state bytes, sent bytes (by kind) and activations in flight after the first
step, the optimizer state's names, and whether a fresh engine that loads the state by name
continues exactly as the trained one."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

from parallel_worker import make_engine
from pipeline_worker import config, micro_batches, train

from lmforge.modes import get_policy
from lmforge.precision.policy import LossScaler
from lmforge.train.loop import train_step
from lmforge.train.setup import build_engine


def one_more_step(engine, cfg, step: int) -> dict[str, torch.Tensor]:
    """Train one step (batches of `step`) and return this rank's model state."""
    policy = get_policy(cfg.train.precision)
    per = cfg.train.batch_size
    r = engine.replica
    batches = iter([(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
                    for x, y in micro_batches(step, cfg.train.micro_batches, engine.replicas * per,
                                              cfg.model.vocab_size, prompts=cfg.finetune.base is not None)])
    train_step(engine, lambda: next(batches), 1, cfg.optim.lr, cfg.optim.grad_clip,
               LossScaler(enabled=policy.loss_scaling), policy, torch.device("cpu"))
    return {k: v.clone() for k, v in engine.model_state_dict().items()}


def resumes_exactly(engine, cfg) -> bool:
    """A fresh engine loading `engine`'s model and optimizer state by name takes the same next step."""
    model_state = {k: v.clone() for k, v in engine.model_state_dict().items()}
    optimizer_state = copy.deepcopy(engine.optimizer_state_dict())  # as read back from disk: no shared tensors
    torch.manual_seed(cfg.train.seed + 1)  # other initial weights: the load must replace them all
    fresh = build_engine(cfg, get_policy(cfg.train.precision))
    fresh.load_model_state_dict(model_state)
    fresh.load_optimizer_state_dict(optimizer_state)
    after, fresh_after = one_more_step(engine, cfg, 99), one_more_step(fresh, cfg, 99)
    equal = torch.tensor(float(all(torch.equal(after[k], fresh_after[k]) for k in after)))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # on every rank
    return bool(equal.item())


def train_and_measure(overrides: list[str]) -> dict:
    """One run of `overrides` on every rank (collective): rank 0's entry of the saved results."""
    cfg = config(overrides)
    torch.manual_seed(cfg.train.seed)
    engine = make_engine(cfg, [])  # a fine-tune starts from parallel_worker.py's base
    held = {}
    original_step = engine.step

    def step_and_measure():  # the bytes held once the first step has made the optimizer states
        original_step()
        held.setdefault("bytes", {**engine.state_bytes(), "sent": engine.comm.sent_bytes("model"),
                                  "sent_optimizer": engine.comm.sent_bytes("optimizer"),
                                  "sent_p2p": dict(engine.p2p_sent),
                                  "sent_tied": engine.tied_comm.sent_bytes("tied") if engine.tied_comm else 0.0,
                                  "sent_tp": engine.tp_comm.sent_bytes("tp") if engine.tp_comm else 0.0,
                                  "in_flight": dict(engine.in_flight)})
    engine.step = step_and_measure
    losses, norms = train(engine, cfg, cfg.train.micro_batches, engine.replica, engine.replicas)
    engine.step = original_step
    mine = {"stage": engine.layout.stage, "replica": engine.replica, "tp_rank": engine.layout.tp_rank,
            "model": engine.model_state_dict(),
            "bytes": held["bytes"], "trainable": sorted(n for n, p in engine.model.named_parameters()
                                                        if p.requires_grad)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    whole = {}
    for part in parts:
        whole.update(part["model"] if part["replica"] == 0 else {})
    optimizer_names = [n for g in engine.optimizer_state_dict()["param_groups"] for n in g["params"]]
    return dict(model=whole, losses=losses, norms=norms, optimizer_names=optimizer_names,
                bytes={(p["replica"], p["stage"]): p["bytes"] for p in parts},  # one tensor rank's
                rank_bytes={(p["replica"], p["stage"], p["tp_rank"]): p["bytes"] for p in parts},
                trainable={(p["replica"], p["stage"]): p["trainable"] for p in parts},
                replicas_equal=all(torch.equal(part["model"][k], whole[k]) for part in parts
                                   for k in part["model"]),
                resumes_exactly=resumes_exactly(engine, cfg))


def main(out: str, runs: str):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for key, overrides in json.loads(runs).items():
        results[key] = train_and_measure(overrides)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
