"""Run by tests/test_tp_cells_dist.py under torchrun (not a test module itself): the composition
matrix's tensor- and context-parallel cells (tests/composition_matrix.py), each given as its
`cell_overrides`, trained STEPS steps of parallel_worker's global batches (each replica on its
rows; a fine-tune from parallel_worker's base, on rows whose prompts have no targets). Pipelines of
tp stages are trained as tests/pipeline_compose_worker.py trains them. Rank 0 saves, per cell, the
losses, gradient norms, the final state by name (whole tensors, fp32), every rank's state bytes
after the last backward, the trainable names, and whether a fresh engine loading the state by name
steps on exactly as the trained one.

    argv: OUT RUNS   RUNS: JSON {cell name: [config overrides]}
"""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from parallel_worker import ROWS, global_batches, make_engine, train  # noqa: E402
from pipeline_compose_worker import train_and_measure  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.precision.policy import LossScaler  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402

STEPS, ACCUM = 3, 2


def cell_config(overrides: list[str]):
    """A cell's config as this worker (and the test's one-process reference) trains it."""
    return make_config("tiny", overrides=[*overrides, "train.sample_tokens=0", f"train.grad_accum={ACCUM}"])


def next_step(engine, cfg) -> dict[str, torch.Tensor]:
    """One more step (step STEPS's global batch, the one an uninterrupted run takes next); the state after it."""
    policy = get_policy(cfg.train.precision)
    rows = slice(engine.replica * ROWS, (engine.replica + 1) * ROWS)
    batches = iter([(x[rows], y[rows]) for x, y in global_batches(STEPS, ACCUM, engine.replicas * ROWS,
                                                                  cfg.model.vocab_size, cfg.finetune.base is not None)])
    train_step(engine, lambda: next(batches), ACCUM, cfg.optim.lr, cfg.optim.grad_clip,
               LossScaler(enabled=policy.loss_scaling), policy, torch.device("cpu"))
    return {k: v.clone() for k, v in engine.model_state_dict().items()}


def resumes_exactly(engine, cfg, model_state: dict, optimizer_state: dict) -> bool:
    """A checkpoint's round trip: a fresh engine (other initial weights) loads the state by name
    and takes the trained engine's next step bit for bit, on every rank."""
    torch.manual_seed(cfg.train.seed + 1)  # another initialisation: the load must replace all of it
    fresh = make_engine(cfg, [])
    fresh.load_model_state_dict(copy.deepcopy(model_state))  # as read back from disk: no shared tensors
    fresh.load_optimizer_state_dict(copy.deepcopy(optimizer_state))
    loaded = all(torch.equal(v, model_state[k]) for k, v in fresh.model_state_dict().items())
    after, fresh_after = next_step(engine, cfg), next_step(fresh, cfg)
    equal = torch.tensor(float(loaded and all(torch.equal(after[k], fresh_after[k]) for k in after)))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal.item())


def run_cell(overrides: list[str], resume: bool) -> dict:
    cfg = cell_config(overrides)
    torch.manual_seed(cfg.train.seed)
    engine = make_engine(cfg, [])  # a fine-tune starts from parallel_worker's base
    held = {}
    losses, norms = train(engine, cfg, STEPS, engine.replica, engine.replicas,
                          on_grads=lambda e: held.update(e.state_bytes()))
    # copies: some engines' states hold live tensors that the next step moves
    model_state, optimizer_state = copy.deepcopy((engine.model_state_dict(), engine.optimizer_state_dict()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    return dict(losses=losses, norms=norms, model={k: v.float() for k, v in model_state.items()}, held=every,
                replicas=engine.replicas, trainable=sorted(n for n, p in engine.model.named_parameters()
                                                           if p.requires_grad),
                resumes_exactly=resumes_exactly(engine, cfg, model_state, optimizer_state) if resume else None)


def main(out: str, runs: dict[str, list[str]]):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {}
    for name, overrides in runs.items():
        piped = any(o.startswith("parallel.pp=") for o in overrides)
        results[name] = (train_and_measure(overrides) if piped
                         else run_cell(overrides, resume=name.endswith("checkpoint + resume")))
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
