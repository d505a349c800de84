"""Run by tests/test_tp_replicated_kv_plan_dist.py under torchrun (not a test module itself): what a
tensor rank of a model with fewer KV heads than ranks (replicated KV heads, parallel/tp.py) really
holds and sends, for the test to set beside the plan (accounting/).

For each run (name -> overrides of the `tiny` model, parallel.tp given), rank 0 saves, per rank,
tests/tp_accounting_worker.py's measurement (the first step's bytes sent by kind, the next
micro-batch's saved bytes, the tensors' bytes after its backward) and the engine's own
`state_bytes()` (ZeRO's shards and master weights included) after the first step, and the loss of
the next micro-batch (after one update).
"""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402
from tp_accounting_worker import BATCH, batch  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.accounting.measure import measure_saved_bytes  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.precision.policy import LossScaler, autocast  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402


def measure(overrides: list[str]) -> dict:
    tp = int(next(o for o in overrides if o.startswith("parallel.tp=")).split("=")[1])
    cfg = tp_config(tp, dist.get_world_size(), [f"train.batch_size={BATCH}", *overrides])
    policy = get_policy(cfg.train.precision)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, policy)
    batches = iter([batch(cfg, engine.replica, k) for k in range(cfg.train.grad_accum)])
    held, zero_grad = {}, engine.zero_grad
    engine.zero_grad = lambda: (held.update(engine.state_bytes()), zero_grad())  # after the step, gradients alive
    train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip,
               LossScaler(enabled=False), policy, torch.device("cpu"))  # the first step's traffic, counted
    sent = {"tp": engine.tp_comm.sent_bytes("tp"),
            "model": engine.comm.sent_bytes("model") if engine.comm is not None else 0.0}
    x, y = batch(cfg, engine.replica, cfg.train.grad_accum)
    with measure_saved_bytes(engine.model.parameters) as saved, autocast(policy, torch.device("cpu")):
        loss = engine.model(x, y)  # after one update: the step's gradients at work
    return dict(saved=saved.activations, held=held, sent=sent, next_loss=loss.item())


if __name__ == "__main__":
    gather_runs(lambda name, overrides: measure(overrides))
