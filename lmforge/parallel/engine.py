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
of single-process training. Every engine is built with the run's mesh groups (parallel/mesh.py's
`ParallelGroups`) and does what the other dimensions change through them, not through subclasses
(torchtitan's ParallelDims handing sub-meshes to one parallelize function):

    comm          the data-parallel ranks (dp, or dp x cp): gradients reduced or states sharded
                  over them (None for strategy none)
    tp_comm       with parallel.tp > 1: the gradient norm sums a split matrix's squares over the
                  tp group, state by name is gathered whole along each tensor's `tp_dim` to save
                  and sliced to load (tp_engine.py), Muon gathers its matrices over tp, and the
                  parameter count is the whole model's
    cp            with parallel.cp > 1: `loss_divisors` counts each replica's targets once
    replicas      the dp degree and this rank's dp index: the loader's rows (the cp and tp ranks of
    replica       a replica draw the same)
"""

import contextlib
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lmforge.accounting.measure import model_state_bytes_measured
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.optim.clip import clip_grad_norm, scale_to_norm
from lmforge.parallel.mesh import ONE_PROCESS, ParallelGroups
from lmforge.parallel.tp import shard_copies, sharded_dim
from lmforge.parallel.tp_engine import (found_inf_anywhere, tp_square_sum, whole_matrices_over_tp,
                                        whole_over_tp)
from lmforge.precision.policy import autocast


class Engine:
    """Strategy "none": one replica (one process, or the tp ranks of one tensor-parallel model)."""

    measures_activations = False  # True where the engine measures what its forwards save (a pipeline stage)
    data_parallel = False  # True: gradients reduced (or states sharded) over the mesh's `comm`
    # True where each rank holds a disjoint part of the gradients (ZeRO, FSDP): the norm is then
    # a sum over ranks; False where every rank holds them all (DDP)
    grads_sharded = False
    # False where the step's model collectives bypass `comm`, which cannot count them (FSDP2's own)
    counts_model_traffic = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, groups: ParallelGroups = ONE_PROCESS):
        self.model, self.optimizer = model, optimizer
        self.comm = groups.comm if self.data_parallel else None  # the counting collectives (parallel/comm.py)
        self.norm_comm = self.comm  # the ranks whose gradient pieces are disjoint (hybrid sharding: a shard group)
        self.world_size, self.rank = (self.comm.world, self.comm.rank) if self.comm is not None else (1, 0)
        # which copy of the model this rank trains, of how many (the data-parallel ranks: the loader
        # shards its rows by them, and the cp and tp ranks of a replica draw the same ones)
        self.replicas, self.replica = groups.dp, groups.dp_rank
        self.tp_comm, self.cp = groups.tp_comm, groups.cp
        self.syncing = True  # False inside no_sync(): the gradient hooks then only accumulate
        if optimizer is not None and self.tp_comm is not None:  # whole tp slices: Muon gathers its matrices
            whole_matrices_over_tp(optimizer, self.tp_comm)

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
        without one). One all-reduce of an integer and one host sync per step.

        With cp > 1 the gradients are averaged over the dp x cp ranks and a micro-batch's loss on a
        CP rank averages, over its replica's cp ranks, to the replica's mean over n_i: as above with
        `replicas` = dp, but the sum over dp x cp ranks counts each replica's targets cp times."""
        counts = torch.stack([(y != IGNORE_INDEX).sum() for y in targets])
        total = counts.sum()
        if self.comm is not None and self.comm.world > 1:
            self.comm.all_reduce(total, kind="scalar")
        *counts, total = torch.cat([counts, total[None]]).tolist()
        return [total / (self.cp * self.replicas * n) for n in counts]

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, without gradients (evaluation)."""
        with torch.no_grad():
            return self.model(x, y)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation micro-steps: backward communicates nothing until the last one."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def finish_gradients(self) -> None:
        """Wait until every gradient of the step is reduced (averaged over the ranks)."""

    def local_pieces(self, leave_out: nn.Parameter | None = None) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient this rank unscales and clips, its parameter) after finish_gradients, but
        `leave_out`'s (a pipeline's tied matrix's second copy, for the norm)."""
        return [(p.grad, p) for p in dict.fromkeys(self.model.parameters())
                if p.grad is not None and p is not leave_out]

    @torch.no_grad()
    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        """Unscale (fp16), then clip to the global norm; (found inf/NaN, norm before clipping). Every
        rank skips the same steps (inf on any rank's gradients skips it everywhere); the norm sums
        the ranks' squares where their pieces are disjoint, and with tp a split matrix's over the tp
        group, a whole one's once (tp_engine.py's tp_square_sum)."""
        pieces = self.local_pieces()
        grads = [g for g, _ in pieces]
        if scaler.enabled and found_inf_anywhere(scaler, grads, self.tp_comm, self.comm):
            return True, torch.tensor(float("inf"))
        if self.tp_comm is None:
            reduce = (lambda t: self.norm_comm.all_reduce(t, kind="scalar")) if self.grads_sharded else None
            return False, clip_grad_norm([SimpleNamespace(grad=g) for g in grads], max_norm, sum_across_ranks=reduce)
        total = tp_square_sum(pieces, self.tp_comm)
        if self.grads_sharded:
            self.norm_comm.all_reduce(total, kind="scalar")
        total_norm = total.sqrt()
        scale_to_norm(grads, total_norm, max_norm)
        return False, total_norm

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank number (the loss of this rank's rows) averaged over the ranks."""
        if self.comm is None:
            return value
        value = value.detach().clone()
        self.comm.all_reduce(value, kind="scalar")
        return value / self.world_size

    def broadcast_from_rank0(self) -> None:
        """Every rank starts from rank 0's weights (the same seed gives the same ones; this makes
        it so whatever the seed)."""
        for tensor in list(dict.fromkeys(self.model.parameters())) + list(self.model.buffers()):
            self.comm.broadcast(tensor.data, kind="state")

    # -- state by parameter name, full tensors (whole over tp); the strategies override the _local ones --

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Every entry of the unwrapped model's state_dict (tied names both present), full tensors."""
        return whole_over_tp(self.model, self._local_model_state(), self.tp_comm, gather=True)

    def optimizer_state_dict(self) -> dict:
        """{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}."""
        return whole_over_tp(self.model, self._local_optimizer_state(), self.tp_comm, gather=True, optimizer=True)

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._load_local_model_state(whole_over_tp(self.model, state, self.tp_comm, gather=False))

    def load_optimizer_state_dict(self, state: dict) -> None:
        self._load_local_optimizer_state(whole_over_tp(self.model, state, self.tp_comm, gather=False, optimizer=True))

    def _local_model_state(self) -> dict[str, torch.Tensor]:
        # the model's own state_dict: its wrappers (recomputation, compile) already give canonical
        # names, which get_model_state_dict would trip over (it expects compile's `_orig_mod`)
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def _local_optimizer_state(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def _load_local_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def _load_local_optimizer_state(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)

    # -- a model cut into stages (parallel/pipeline/) sums and merges these over its stages -----------

    def num_params(self) -> int:
        """Parameters of the whole model (shared tensors once; with tp, every tp rank's slices)."""
        if self.tp_comm is None:
            return self.model.num_params()
        return sum(p.numel() * (self.tp_comm.world // shard_copies(p) if sharded_dim(p) is not None else 1)
                   for p in dict.fromkeys(self.model.parameters()))

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
        return {**model_state_bytes_measured(self.model, self.optimizer), "master_weights": 0}
