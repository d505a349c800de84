"""Run by tests/test_tp_zero_dist.py under torchrun (not a test module itself): one mesh of
dp x tp ranks (parallel.tp=TP, world / TP replicas), the `tiny` model trained STEPS steps of
parallel_worker's global batches under each data-parallel strategy given (ddp, zero1-3, fsdp), each
replica on its rows; rank 0 saves, per strategy and per rank, what the test compares: the losses
and gradient norms, the final state by name (full tensors), that state loaded back into a fresh
engine and one more step from it and from the trained engine, the bytes held after the last
backward, and the data-parallel bytes one step sent.

    python -m torch.distributed.run --nproc_per_node=4 tests/tp_zero_worker.py OUT '{"zero2": [...]}'
"""

import copy
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402
from parallel_worker import ROWS, global_batches, train  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.modes import get_policy  # noqa: E402
from lmforge.precision.policy import LossScaler  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

TP, STEPS = 2, 3


def build(cfg, seed: int):
    torch.manual_seed(seed)
    return build_engine(cfg, get_policy(cfg.train.precision))


def run(strategy: str, extra: list[str]) -> dict:
    cfg = tp_config(TP, dist.get_world_size(), [f"train.parallel={strategy}", *extra])
    engine = build(cfg, cfg.train.seed)
    held = {}
    losses, norms = train(engine, cfg, STEPS, engine.replica, engine.replicas,
                          on_grads=lambda e: held.update(e.state_bytes()))
    sent = engine.comm.sent_bytes("model")  # the last step's (train resets the count before it)
    # copies: DDP's state holds the live whole tensors (norm gains, step counts), which the next step moves
    model_state, optimizer_state = copy.deepcopy((engine.model_state_dict(), engine.optimizer_state_dict()))
    fresh = build(cfg, cfg.train.seed + 1)  # another initialisation: the load must replace all of it
    fresh.load_model_state_dict(copy.deepcopy(model_state))
    fresh.load_optimizer_state_dict(copy.deepcopy(optimizer_state))
    reloaded = copy.deepcopy((fresh.model_state_dict(), fresh.optimizer_state_dict()))
    # one more step from each: a resume takes the step the uninterrupted run takes (step STEPS's batch)
    after = [train_from(e, cfg) for e in (engine, fresh)]
    return dict(losses=losses, norms=norms, model=model_state, optimizer=optimizer_state, reloaded=reloaded,
                held=held, sent=sent, num_params=engine.num_params(), next_step=after)


def train_from(engine, cfg) -> float:
    """The loss of one step on step STEPS's batch (the step parallel_worker.train would take next)."""
    rows = slice(engine.replica * ROWS, (engine.replica + 1) * ROWS)
    batches = iter([(x[rows], y[rows]) for x, y in global_batches(STEPS, cfg.train.grad_accum, engine.replicas * ROWS,
                                                                  cfg.model.vocab_size)])
    loss, _, _ = train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip,
                            LossScaler(enabled=False), get_policy(cfg.train.precision), torch.device("cpu"))
    return loss.item()


if __name__ == "__main__":
    gather_runs(lambda name, overrides: run(name.split("@")[0], overrides))
