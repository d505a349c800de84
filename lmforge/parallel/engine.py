"""The interface the trainer drives for every data-parallel strategy, and its one-process form.

One optimizer step, whatever the strategy (train/loop.py, `train_step`):

    engine.forward_backward(...)         the step's micro-batches, each loss divided by its share of
                                         the step's target tokens (`loss_divisors`):
        for each micro-batch but the last:   with engine.no_sync(): backward  (no communication)
        last micro-batch:                    backward                         (reductions start)
                                         (a pipeline stage runs its schedule instead: pipeline/engine.py)
    engine.finish_gradients()            wait for the reductions: gradients averaged over ranks
    engine.unscale_and_clip(scaler, c)   fp16 found-inf and the global gradient norm, over all ranks
    engine.step()                        the optimizer (and, for ZeRO, the parameter all-gather)
    engine.zero_grad()

`engine.model` is what forward runs and `engine.optimizer` holds the param groups the schedule
sets the learning rate in. State goes in and out by parameter name with full tensors on every rank
(`model_state_dict`, `optimizer_state_dict` in `torch.distributed.checkpoint`'s
`get_optimizer_state_dict` layout, and their loads, after which each rank keeps its own shard),
so a checkpoint written under one strategy and world size loads under any other.

`Engine` itself is strategy "none": one process, the optimizer over the model's own parameters,
the same calls in the same order as before engines existed, so its numbers are bit for bit those
of single-process training.
"""

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lmforge.model.transformer import IGNORE_INDEX
from lmforge.optim.clip import clip_grad_norm
from lmforge.precision.policy import autocast


def unique_storages_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        if t is not None and hasattr(t, "to_local"):  # a DTensor: this rank's part
            t = t.to_local()
        if t is not None and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Engine:
    """Strategy "none": one process."""

    world_size, rank = 1, 0
    replica, replicas = 0, 1  # which copy of the model this rank trains, of how many (the data-parallel ranks)
    measures_activations = False  # True where the engine measures what its forwards save (a pipeline stage)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.comm = None  # the counting collectives (parallel/comm.py) of distributed engines

    def forward_backward(self, next_batch, grad_accum: int, scaler, policy, device: torch.device) -> torch.Tensor:
        """Forward and backward of the step's `grad_accum` micro-batches from `next_batch()`, each
        loss divided by its `loss_divisors` so that the gradient is that of the step's mean loss,
        communicating only in the last one's backward. Returns the sum of those losses."""
        batches = [next_batch() for _ in range(grad_accum)]  # their target counts come first
        divisors = self.loss_divisors([y for _, y in batches])
        loss_sum = torch.zeros((), device=device)
        for micro, ((x, y), divisor) in enumerate(zip(batches, divisors)):
            with self.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext():
                with autocast(policy, device):
                    loss = self.model(x, y) / divisor
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        return loss_sum

    def loss_divisors(self, targets: list[torch.Tensor]) -> list[float]:
        """What each micro-batch loss of this rank is divided by, for the step's loss to be the mean
        over all its target tokens: every micro-batch's, every replica's.

        The model's loss of micro-batch i is the mean over its n_i targets (those not IGNORE_INDEX),
        and the step has n on all replicas, so the step's loss is sum_i n_i mean_i / n; the engines
        average gradients (sum / replicas), so mean_i is divided by n / (replicas n_i). Where every
        micro-batch holds as many targets (text windows: every position), that is grad_accum
        exactly, and the step is what dividing by grad_accum gave, bit for bit; fine-tuning examples
        hold as many as their responses, and a plain mean of the means would weigh the tokens of
        short responses more. Every micro-batch holds a target (data/sft.py refuses an example
        without one). One all-reduce of an integer and one host sync per step."""
        counts = torch.stack([(y != IGNORE_INDEX).sum() for y in targets])
        total = counts.sum()
        if self.replicas > 1:
            self.comm.all_reduce(total, kind="scalar")
        *counts, total = torch.cat([counts, total[None]]).tolist()
        return [total / (self.replicas * n) for n in counts]

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, without gradients (evaluation)."""
        with torch.no_grad():
            return self.model(x, y)

    def no_sync(self):
        """Accumulation micro-steps: gradients stay local until the last micro-batch's backward."""
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        """Wait until every gradient of the step is reduced (averaged over the ranks)."""

    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        """Unscale (fp16), then clip to the global norm; (found inf/NaN, norm before clipping)."""
        found_inf = scaler.unscale_(self.model.parameters()) if scaler.enabled else False
        if found_inf:
            return True, torch.tensor(float("inf"))
        return False, clip_grad_norm(self.model.parameters(), max_norm)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank number (the loss of this rank's rows) averaged over the ranks."""
        return value

    # -- state by parameter name, full tensors ------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Every entry of the unwrapped model's state_dict (tied names both present), full tensors."""
        # the model's own state_dict: its wrappers (recomputation, compile) already give canonical
        # names, which get_model_state_dict would trip over (it expects compile's `_orig_mod`)
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def optimizer_state_dict(self) -> dict:
        """{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}."""
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def load_optimizer_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)

    # -- a model cut into stages (parallel/pipeline/) sums and merges these over its stages -----------

    def num_params(self) -> int:
        """Parameters of the whole model (shared tensors once)."""
        return self.model.num_params()

    def model_names(self) -> set[str]:
        """The names of the whole model's state."""
        return set(self.model_state_dict())

    def total_over_stages(self, count: int, state: dict[str, torch.Tensor]) -> int:
        return count

    def merged_over_stages(self, per_stage: dict) -> dict:
        return per_stage

    # -- what this rank holds ------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients, separate master weights and optimizer
        states, read off the live tensors (views of one buffer once; step counters left out)."""
        params = list(dict.fromkeys(self.model.parameters()))
        return {"parameters": unique_storages_bytes(params),
                "gradients": unique_storages_bytes(p.grad for p in params),
                "master_weights": 0,
                "optimizer_states": optimizer_state_bytes(self.optimizer)}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return unique_storages_bytes(t for state in optimizer.state.values() for t in state.values()
                                 if isinstance(t, torch.Tensor) and t.ndim > 0)


class DistributedEngine(Engine):
    """What every multi-rank engine shares: the counting collectives, the loss average, and the
    found-inf and gradient norm reduced over the ranks."""

    # True where each rank holds a disjoint part of the gradients (ZeRO, FSDP): the norm is then
    # a sum over ranks; False where every rank holds them all (DDP).
    grads_sharded = True

    def __init__(self, model, optimizer, comm):
        super().__init__(model, optimizer)
        self.comm = comm
        self.norm_comm = comm  # the ranks whose gradient pieces are disjoint (hybrid sharding: a shard group)
        self.world_size, self.rank = comm.world, comm.rank
        self.replicas, self.replica = comm.world, comm.rank
        self.syncing = True  # False inside no_sync(): the gradient hooks then only accumulate

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation micro-steps: backward communicates nothing until the last one."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def local_grads(self) -> list[torch.Tensor]:
        """The gradients this rank unscales and clips, after finish_gradients."""
        raise NotImplementedError

    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        holders = [SimpleNamespace(grad=g) for g in self.local_grads()]  # what the scaler and clip read
        if scaler.enabled:
            # every rank must skip the same steps: inf on any rank's gradients skips it everywhere
            found = torch.tensor(float(scaler.unscale_(holders)))
            self.comm.all_reduce(found, op=dist.ReduceOp.MAX, kind="scalar")
            if found.item():
                return True, torch.tensor(float("inf"))
        reduce = (lambda t: self.norm_comm.all_reduce(t, kind="scalar")) if self.grads_sharded else None
        return False, clip_grad_norm(holders, max_norm, sum_across_ranks=reduce)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        self.comm.all_reduce(value, kind="scalar")
        return value / self.world_size

    def broadcast_from_rank0(self) -> None:
        """Every rank starts from rank 0's weights (the same seed gives the same ones; this makes
        it so whatever the seed)."""
        for tensor in list(dict.fromkeys(self.model.parameters())) + list(self.model.buffers()):
            self.comm.broadcast(tensor.data, kind="state")
