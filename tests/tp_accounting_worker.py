"""Run by tests/test_tp_accounting_dist.py under torchrun (not a test module itself): what a
tensor-parallel rank really holds and sends, for the test to set beside the plan (accounting/).

For each run (name -> overrides of the `tiny` model, parallel.tp given), rank 0 saves, per rank:
the bytes one optimizer step (the first) sent, by kind ("tp": tensor-parallel activations;
"model": the data-parallel gradients), the bytes saved for backward by the next micro-batch's
forward (accounting/measure.py), and the bytes of parameters, gradients and optimizer states after
its backward.
"""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.precision.policy import LossScaler, autocast  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

BATCH, SEQ = 4, 64  # rows per micro-batch (every tp rank of a replica reads the same rows), tokens


def batch(cfg, replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def measure(overrides: list[str]) -> dict:
    tp = int(next(o for o in overrides if o.startswith("parallel.tp=")).split("=")[1])
    cfg = tp_config(tp, dist.get_world_size(), [f"train.batch_size={BATCH}", *overrides])
    policy = get_policy(cfg.train.precision)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, policy)
    batches = iter([batch(cfg, engine.replica, k) for k in range(cfg.train.grad_accum)])
    train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip,
               LossScaler(enabled=False), policy, torch.device("cpu"))  # the first step's traffic, counted
    tp_comm = getattr(engine, "tp_comm", None)  # none at parallel.tp=1
    sent = {"tp": tp_comm.sent_bytes("tp") if tp_comm is not None else 0.0,
            "model": engine.comm.sent_bytes("model") if engine.comm is not None else 0.0}
    x, y = batch(cfg, engine.replica, cfg.train.grad_accum)
    with measure_saved_bytes(engine.model.parameters) as saved, autocast(policy, torch.device("cpu")):
        loss = engine.model(x, y)
    loss.backward()  # the gradients exist, beside the optimizer's states
    return dict(saved=saved.activations, state=model_state_bytes_measured(engine.model, engine.optimizer), sent=sent)


if __name__ == "__main__":
    gather_runs(lambda name, overrides: measure(overrides))
