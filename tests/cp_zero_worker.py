"""Run by tests/test_cp_zero_dist.py under torchrun (not a test module itself): parallel.cp=2 with
each data-parallel strategy (ddp, zero1-3, fsdp) over the dp x cp ranks (dp = world / (2 tp)),
the `tiny` model trained STEPS steps of parallel_worker's global batches, both cp ranks of a
replica on its rows. Rank 0 saves, per run and per rank: the losses and gradient norms, the final
state by name (full tensors), that state loaded back into a fresh engine, one more step from each,
the bytes held after the last backward and the data-parallel bytes one step sent. A run named
`one@N` is one process on the whole global batch of N replicas' rows (the reference); any other
`S@variant` is strategy S with the run's overrides (e.g. parallel.tp=2: tp x cp).

    python -m torch.distributed.run --nproc_per_node=4 tests/cp_zero_worker.py OUT '{"zero2": [], "one@2": []}'
"""

import copy
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402
from parallel_worker import ROWS, train  # noqa: E402
from tp_zero_worker import STEPS, build, train_from  # noqa: E402

from lmforge.config import make_config  # noqa: E402

CP, ACCUM = 2, 2
COMMON = ["train.sample_tokens=0", f"train.grad_accum={ACCUM}", "optim.lr=3e-3"]


def cp_config(strategy: str, extra=()):
    return make_config("tiny", overrides=[f"parallel.cp={CP}", f"train.parallel={strategy}", *COMMON, *extra])


def one_process(replicas: int, extra: list[str]) -> dict:
    cfg = make_config("tiny", overrides=[*COMMON, *extra])
    engine = build(cfg, cfg.train.seed)
    losses, norms = train(engine, cfg, STEPS, 0, 1, rows=replicas * ROWS)
    return dict(losses=losses, norms=norms, model=engine.model_state_dict())


def run(strategy: str, extra: list[str]) -> dict:
    cfg = cp_config(strategy, extra)
    engine = build(cfg, cfg.train.seed)
    held = {}
    losses, norms = train(engine, cfg, STEPS, engine.replica, engine.replicas,
                          on_grads=lambda e: held.update(e.state_bytes()))
    sent = engine.comm.sent_bytes("model")  # the last step's (train resets the count before it)
    # copies: DDP's state holds the live whole tensors, which the next step moves
    model_state, optimizer_state = copy.deepcopy((engine.model_state_dict(), engine.optimizer_state_dict()))
    fresh = build(cfg, cfg.train.seed + 1)  # another initialisation: the load must replace all of it
    fresh.load_model_state_dict(copy.deepcopy(model_state))
    fresh.load_optimizer_state_dict(copy.deepcopy(optimizer_state))
    reloaded = copy.deepcopy((fresh.model_state_dict(), fresh.optimizer_state_dict()))
    after = [train_from(e, cfg) for e in (engine, fresh)]  # a resume takes the uninterrupted run's step
    return dict(losses=losses, norms=norms, model=model_state, optimizer=optimizer_state, reloaded=reloaded,
                held=held, sent=sent, next_step=after, replica=engine.replica, replicas=engine.replicas,
                num_params=engine.num_params())


def measure(name: str, overrides: list[str]) -> dict:
    strategy, _, variant = name.partition("@")
    if strategy == "one":
        return one_process(int(variant), overrides)
    return run(strategy, overrides)


if __name__ == "__main__":
    gather_runs(measure)
