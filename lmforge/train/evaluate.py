"""The validation loss of a run: the mean loss over a fixed set of validation batches."""

import torch

from lmforge.data.loader import window_batch
from lmforge.model.transformer import Transformer
from lmforge.modes.precision import Policy
from lmforge.parallel.parallelize import Engine
from lmforge.parallel.world import World
from lmforge.precision.policy import autocast


@torch.no_grad()
def evaluate(model: Transformer, tokens, batch_size: int, seq_len: int, seed: int, batches: int,
             device: torch.device, policy: Policy, world: World = World(),
             make_batch=window_batch, engine: Engine | None = None, stopping=None) -> float | None:
    """Mean loss over a fixed set of `batches` batches (the same ones at every evaluation),
    computed as training computes it (under the forward autocast of `policy`); `make_batch`
    draws them (windows, or fine-tuning examples: data/sft.py's example_batch). Each replica takes
    its rows of the global batches and the means are averaged over the ranks: N ranks of
    batch_size B evaluate what one process of N*B does. With an `engine`, its `eval_loss` runs the
    forward (a pipeline's goes through every stage) and its replicas share the batches.
    `stopping()`, asked before each batch (every rank asks: it may be a collective), returns a stop
    request or None: on a request the evaluation is abandoned and None returned."""
    was_training = model.training
    model.eval()
    losses = []
    replica, replicas = (engine.replica, engine.replicas) if engine is not None else (world.rank, world.world_size)
    loss_of = engine.eval_loss if engine is not None else model
    for index in range(batches):
        if stopping is not None and stopping() is not None:
            break
        x, y = make_batch(tokens, batch_size, seq_len, seed, index, rank=replica, world_size=replicas)
        with autocast(policy, device):
            losses.append(loss_of(x.to(device), y.to(device)).item())
    model.train(was_training)
    if len(losses) < batches:  # stopped: every rank at the same batch
        return None
    return world.mean(sum(losses) / len(losses))
