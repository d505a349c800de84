"""Run by tests/test_cp_accounting_dist.py under torchrun (not a test module itself): what a
context-parallel rank really holds, saves and sends, for the test to set beside the plan.

For each run (name -> overrides of the `tiny` model, parallel.cp given, train.parallel=ddp), rank 0
saves, per rank: the bytes the first optimizer step sent (the dp x cp gradient all-reduce, the
ring's K/V and dK/dV), the bytes saved for backward by the next micro-batch's forward
(accounting/measure.py) and the model states after its backward, as tests/tp_accounting_worker.py.
"""

import sys

import torch

from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.config import make_config
from lmforge.modes import get_policy
from lmforge.parallel.cp_model import RingAttentionCore
from lmforge.precision.policy import LossScaler, autocast
from lmforge.train.loop import train_step
from lmforge.train.setup import build_engine

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402

BATCH, ACCUM = 4, 2  # rows per micro-batch (every cp rank of a replica reads the same rows); tokens: train.seq_len


def cp_config(overrides: list[str]):
    return make_config("tiny", overrides=["train.parallel=ddp", "train.sample_tokens=0", f"train.grad_accum={ACCUM}",
                                          f"train.batch_size={BATCH}", *overrides])


def batch(cfg, replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def measure(overrides: list[str]) -> dict:
    cfg = cp_config(overrides)
    policy = get_policy(cfg.train.precision)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, policy)
    traffic = next(m.traffic for m in engine.model.modules() if isinstance(m, RingAttentionCore))
    traffic.reset()
    batches = iter([batch(cfg, engine.replica, k) for k in range(cfg.train.grad_accum)])
    train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr, cfg.optim.grad_clip,
               LossScaler(enabled=False), policy, torch.device("cpu"))  # the first step's traffic, counted
    sent = {"model": engine.comm.sent_bytes("model"), "ring": traffic.bytes["forward"] + traffic.bytes["backward"]}
    tp_comm = getattr(engine, "tp_comm", None)
    if tp_comm is not None:
        sent["tp"] = tp_comm.sent_bytes("tp")
    x, y = batch(cfg, engine.replica, cfg.train.grad_accum)
    with measure_saved_bytes(engine.model.parameters) as saved, autocast(policy, torch.device("cpu")):
        loss = engine.model(x, y)
    loss.backward()  # the gradients exist, beside the optimizer's states
    return dict(saved=saved.activations, state=model_state_bytes_measured(engine.model, engine.optimizer), sent=sent)


if __name__ == "__main__":
    gather_runs(lambda name, overrides: measure(overrides))
