"""Run by tests/test_sp_cp_dist.py under torchrun on 4 ranks (not a test module itself): one launch
for every run of that file, each named `kind:label` (argv: OUT, a JSON dict name -> overrides):

    train:...   tests/cp_train_worker.py's run_case (parallel.cp=2, ddp; tp and the rest in the
                overrides): 3 steps against one process computed on every rank
    grads:...   the same engines' first step's gradients (before clipping), gathered to full
                tensors by name (tests/tp_worker.py's gathered_grads), and one process's
    plan:...    tests/cp_accounting_worker.py's measure: bytes saved, held and sent by each rank
    fsdp:...    tests/tp_zero_worker.py's run on the dp 2 x tp 2 mesh (the strategy after the colon's
                first word: fsdp or ddp)

rank 0 saves {name: [result of rank 0, 1, 2, 3]} (tests/gather_runs.py).
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cp_accounting_worker import measure  # noqa: E402
from cp_train_worker import ACCUM, CP, run_case  # noqa: E402
from gather_runs import gather_runs  # noqa: E402
from parallel_worker import ROWS, global_batches  # noqa: E402
from tp_worker import gathered_grads  # noqa: E402
from tp_zero_worker import run as run_mesh  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.precision.policy import LossScaler  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402


def first_gradients(engine, cfg, rows: slice, global_rows: int, seq: int) -> dict:
    """The gradients of the first step's ACCUM micro-batches, reduced (before clipping), by name."""
    batches = iter([(x[rows, :seq], y[rows, :seq]) for x, y in global_batches(0, ACCUM, global_rows,
                                                                              cfg.model.vocab_size)])
    policy = get_policy(cfg.train.precision)
    engine.forward_backward(lambda: next(batches), ACCUM, LossScaler(enabled=False), policy, torch.device("cpu"))
    engine.finish_gradients()
    tp_comm = getattr(engine, "tp_comm", None)
    if tp_comm is None:
        return {name: p.grad.clone() for name, p in engine.model.named_parameters()}
    return gathered_grads(engine.model, tp_comm)


def gradients(overrides: list[str]) -> dict:
    seq = next((int(o[4:]) for o in overrides if o.startswith("seq=")), 32)
    common = ["train.sample_tokens=0", f"train.grad_accum={ACCUM}", *[o for o in overrides if not o.startswith("seq=")]]
    cfg = make_config("tiny", overrides=[f"parallel.cp={CP}", "train.parallel=ddp", *common])
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    r, global_rows = engine.replica, engine.replicas * ROWS
    grads = first_gradients(engine, cfg, slice(r * ROWS, (r + 1) * ROWS), global_rows, seq)
    one_cfg = make_config("tiny", overrides=[o for o in common if not o.startswith("parallel.")])
    torch.manual_seed(one_cfg.train.seed)
    one = build_engine(one_cfg, get_policy(one_cfg.train.precision))
    return dict(grads=grads, ref=first_gradients(one, one_cfg, slice(None), global_rows, seq))


def run(name: str, overrides: list[str]) -> dict:
    kind, label = name.split(":", 1)
    if kind == "train":
        return run_case(overrides)
    if kind == "grads":
        return gradients(overrides)
    if kind == "plan":
        return measure(overrides)
    if kind == "fsdp":
        return run_mesh(label.split()[0], overrides)
    raise ValueError(f"unknown run kind {kind!r}")


if __name__ == "__main__":
    gather_runs(run)
