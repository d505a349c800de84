"""Run by tests/test_tp_precision_dist.py under torchrun (not a test module itself): tensor-parallel
cells (parallel.tp=2; with 4 ranks tp=2 x 2 replicas under ddp, zero1-3 or fsdp, or tp=2 x cp=2) in
fp16-mixed and fp8, each trained STEPS steps of parallel_worker's global batches. Rank 0 saves, per
cell: the losses and gradient norms, the final state (whole tensors by name), the bytes rank 0
holds (before the last step's zero_grad), the tp group's ring bytes of one step (kind "tp"),
rank 0's fp8 amax histories, and whether every rank ended with the same loss scaler and the same
copy of every whole parameter and of the amax histories.

A cell's name ending in "+inf" injects an inf into one gradient element on global rank 0 only,
at step INF_STEP, before the found-inf check: every rank must skip that step.

    argv: OUT RUNS   RUNS: JSON {cell name: [config overrides]}
"""

import datetime
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from parallel_worker import ROWS, global_batches  # noqa: E402
from tp_worker import STEPS, tp_config  # noqa: E402

from lmforge.modes import get_policy  # noqa: E402
from lmforge.parallel.fsdp import local  # noqa: E402
from lmforge.parallel.tp import sharded_dim  # noqa: E402
from lmforge.precision.policy import LossScaler, fp8_scale_state  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

TP, INF_STEP = 2, 1


def first_grad(engine) -> torch.Tensor:
    """A gradient tensor this rank unscales (ZeRO: its first piece; else its first parameter's)."""
    if hasattr(engine, "_pieces"):
        return engine._pieces()[0][0]
    return next(local(p.grad) for p in engine.model.parameters() if p.grad is not None)


def inject_inf_at(engine, step_of, inject: bool) -> None:
    """Before the found-inf check of step INF_STEP, set one gradient element to inf (where `inject`)."""
    unscale_and_clip = engine.unscale_and_clip

    def with_inf(scaler, max_norm):
        if inject and step_of() == INF_STEP:
            first_grad(engine).view(-1)[0] = float("inf")
        return unscale_and_clip(scaler, max_norm)
    engine.unscale_and_clip = with_inf


def run(engine, cfg, rank: int, ranks: int, rows: int = ROWS, inject: bool = False, tp_comm=None) -> dict:
    """STEPS steps on global batches of ranks * rows rows (rank `rank` takes its rows), as
    parallel_worker.train, keeping the loss scaler, the held bytes and one step's tp traffic."""
    policy = get_policy(cfg.train.precision)
    scaler, losses, norms, step, held = LossScaler(enabled=policy.loss_scaling), [], [], [0], {}
    inject_inf_at(engine, lambda: step[0], inject)
    zero_grad = engine.zero_grad
    engine.zero_grad = lambda: (held.update(engine.state_bytes()) if step[0] == STEPS - 1 else None, zero_grad())
    for i in range(STEPS):
        step[0] = i
        batches = iter([(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
                        for x, y in global_batches(step[0], cfg.train.grad_accum, ranks * rows, cfg.model.vocab_size)])
        if tp_comm is not None and step[0] == STEPS - 1:
            tp_comm.reset()  # count one step's traffic
        loss, norm, _ = train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr,
                                   cfg.optim.grad_clip, scaler, policy, torch.device("cpu"))
        losses.append(loss.item())
        norms.append(norm.item())
    return dict(losses=losses, norms=norms, held=held, scaler=(scaler.scale_value, scaler.skipped_steps),
                fp8_scales=fp8_scale_state(engine.model),
                model={k: v.float() for k, v in engine.model_state_dict().items()})


def every_rank_agrees(engine, result: dict) -> bool:
    """The same loss scaler, amax histories and whole (unsplit) tensors on every rank (read from
    the engine's state by name: ZeRO-3 frees its parameters' storage between steps)."""
    whole = sorted(name for name, t in engine.model.state_dict(keep_vars=True).items()
                   if sharded_dim(t) is None and name in result["model"])
    mine = (result["scaler"], result["fp8_scales"], [result["model"][name] for name in whole])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    return bool(whole) and all(other[:2] == first[:2] and all(torch.equal(a, b) for a, b in zip(other[2], first[2]))
                               for other in everyone)


def run_cell(name: str, overrides: list[str]) -> dict:
    cfg = tp_config(TP, dist.get_world_size(), overrides)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    result = run(engine, cfg, engine.replica, engine.replicas, inject=name.endswith("+inf") and dist.get_rank() == 0,
                 tp_comm=engine.tp_comm)
    result["tp_ring_bytes"] = engine.tp_comm.ring_bytes["tp"]
    result["agree"] = every_rank_agrees(engine, result)
    return result


def main(out: str, runs: dict[str, list[str]]):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, overrides in runs.items():
        results[name] = run_cell(name, overrides)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
