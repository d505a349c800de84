"""The engines of a tensor-parallel model (parallel/tp.py): strategy none (one replica), or ddp,
ZeRO stages 1-3 or FSDP2 over the data-parallel group (parallel/mesh.py), with what tensor
parallelism changes in them:

  - the gradient norm: a sharded parameter's squares are summed over the tp group, a whole one
    (norms, row-parallel biases: the same gradient on every tp rank) counted once;
  - state by parameter name with full tensors (engine.py's contract): the shards are all-gathered
    along their `tp_dim` to save and sliced again to load, so a checkpoint of a tp=2 run loads in
    one process, and the other way round;
  - the parameter count of the whole model.

Every tp rank draws the same batch: `replica` / `replicas` are the data-parallel ones (the data-
parallel engine's comm is over the dp group; strategy none has one replica), and the loader shards by them.

ZeRO over the dp group (one device mesh, dp x tp; torchtitan's order: tensor parallelism first,
then data-parallel sharding of what each tensor rank holds): each tp rank's local shards are laid
in ZeRO's flat units and those sharded over its dp peers, the ranks of the same tp index
(parallel/zero.py unchanged: it sees a model of smaller matrices and a group of dp ranks). So a
rank holds 1/(tp dp) of a split matrix's states and 1/dp of a whole one's (norm gains). FSDP2
the same way: `fully_shard` over the mesh's dp dimension, applied after the tensor-parallel split
(torchtitan's order); it replaces every parameter, so the engine puts `tp_dim` and `tp_copies` back
on the new ones by name, and sums over tp, after backward, the gradients that tp.py's hooks (lost
with the old parameters) would have summed: the whole parameters' (norms) over every tp rank, a
replicated KV head's over its copies (tp.py's sum_over_copies, on each rank's dp shard).
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lmforge.optim.clip import scale_to_norm
from lmforge.optim.muon import Muon, orthogonalize
from lmforge.parallel.comm import Collectives
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.engine import Engine
from lmforge.parallel.fsdp import FSDPEngine, local
from lmforge.parallel.tp import shard_copies, sharded_dim, sum_over_copies
from lmforge.parallel.zero import ZeroEngine


def gather_full(shard: torch.Tensor, dim: int, comm: Collectives, copies: int = 1,
                kind: str = "state") -> torch.Tensor:
    """The whole tensor whose rank-r slice along `dim` is rank r's `shard` (with `copies` > 1, ranks
    r .. r + copies - 1 hold the same slice: a replicated KV head, kept once); counted under `kind`."""
    parts = shard.detach().movedim(dim, 0).contiguous()
    full = parts.new_empty((comm.world * parts.shape[0], *parts.shape[1:]))
    comm.all_gather(full, parts, kind=kind)
    if copies > 1:  # rank order: each slice `copies` times in a row
        full = full.unflatten(0, (comm.world, parts.shape[0]))[::copies].flatten(0, 1)
    return full.movedim(0, dim).contiguous()


def slice_full(full: torch.Tensor, dim: int, comm: Collectives, copies: int = 1) -> torch.Tensor:
    return full.chunk(comm.world // copies, dim=dim)[comm.rank // copies]


@torch.no_grad()
def tp_square_sum(pieces, tp_comm: Collectives, device=None) -> torch.Tensor:
    """sum ||g||^2 of (gradient, parameter) `pieces` over the tp group: a split parameter's squares
    summed over the tp ranks (a replicated KV head's slice divided by its copies), a whole one's,
    the same on every tp rank, taken once."""
    sharded, whole = torch.zeros((), device=device), torch.zeros((), device=device)
    for grad, param in pieces:
        square = torch.linalg.vector_norm(grad, dtype=torch.float32).square() / shard_copies(param)
        if sharded_dim(param) is None:
            whole += square
        else:
            sharded += square
    tp_comm.all_reduce(sharded, kind="scalar")
    return sharded + whole


@torch.no_grad()
def found_inf_anywhere(scaler, grads, tp_comm: Collectives, comm: Collectives | None) -> bool:
    """fp16-mixed: unscale this rank's gradients; True if any rank of the tp group or of the dp
    group (with them, every rank of the run) found an inf or NaN. Every rank must skip the same
    steps: a rank skipping alone would keep its slice (or its copy of a whole parameter) while the
    others step, and the ranks' loss scales would part. A max of one number over each group."""
    device = grads[0].device if grads else None  # the group's device (NCCL reduces CUDA tensors)
    found = torch.tensor(float(scaler.unscale_([SimpleNamespace(grad=g) for g in grads])), device=device)
    tp_comm.all_reduce(found, op=dist.ReduceOp.MAX, kind="scalar")
    if comm is not None:
        comm.all_reduce(found, op=dist.ReduceOp.MAX, kind="scalar")
    return bool(found.item())


@torch.no_grad()
def sharded_norm_and_clip(pieces, comm: Collectives, tp_comm: Collectives, max_norm: float, scaler):
    """fp16's found-inf over every rank (`scaler` enabled), then the global norm from this rank's
    pieces: disjoint over the dp ranks (ZeRO's or FSDP's slices), and, for a split matrix, over the
    tp ranks too; a whole parameter's piece is the same on every tp rank, so it is counted once
    (summed over dp only), as is a replicated KV head's slice (divided by its copies)."""
    if scaler.enabled and found_inf_anywhere(scaler, [g for g, _ in pieces], tp_comm, comm):
        return True, torch.tensor(float("inf"))
    total = tp_square_sum(pieces, tp_comm)
    comm.all_reduce(total, kind="scalar")
    total_norm = total.sqrt()
    scale_to_norm([grad for grad, _ in pieces], total_norm, max_norm)
    return False, total_norm


class TensorParallelMatrices:
    """Set as a Muon optimizer's `whole_matrices` on a tensor-parallel replica (strategy none or
    ddp): each split matrix's update is all-gathered whole over the tp group along its `tp_dim`,
    orthogonalised, and this rank keeps its slice of the result.

    Why gather rather than split the iteration: NS_5's A = X X^T contracts the matrix's longer
    dimension (optim/muon.py transposes a tall one), so a shard along the shorter one would need X
    gathered in each of the five iterations, and a shard along the longer one an all-reduce of
    partial Gram matrices in each, summed from bf16 partial products, in another rounding than one
    process's. One gather per step (of tp x the slice, in the gradient's dtype, counted under kind
    "tp" so the trainer's tp bytes include it: accounting/comm.py's part "optimizer") hands every
    rank the one-process input, so the step is the one-process step up to the gradients' own
    summation order; the price is that every tp rank runs the whole matrix's Newton-Schulz."""

    def __init__(self, tp_comm: Collectives):
        self.comm = tp_comm

    def orthogonalize(self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict):
        """(each parameter's slice of its orthogonalised whole update, each whole matrix's shape)."""
        orthos, shapes = [], []
        for param, update in zip(params, updates):  # the same parameters in the same order on every tp rank
            dim, copies = sharded_dim(param), shard_copies(param)
            whole = update if dim is None else gather_full(update, dim, self.comm, copies, kind="tp")
            ortho = orthogonalize(whole, group["ns_coefficients"], group["ns_steps"])
            orthos.append(ortho if dim is None else slice_full(ortho, dim, self.comm, copies))
            shapes.append(whole.shape)
        return orthos, shapes


def whole_matrices_over_tp(optimizer, tp_comm: Collectives) -> None:
    """Muon's matrices gathered over the tp group (TensorParallelMatrices); other optimizers are
    element-wise and take the slices as they are."""
    if isinstance(optimizer, Muon):
        optimizer.whole_matrices = TensorParallelMatrices(tp_comm)


class TensorParallelMixin:
    """What a tensor-parallel model changes in an engine; `tp_comm` is the tp group's Collectives."""

    tp_comm: Collectives

    def _tp_dims(self) -> dict[str, int | None]:
        """Every state name (tied ones both) -> the dimension its tensor is split along, or None."""
        return {name: sharded_dim(t) for name, t in self.model.state_dict(keep_vars=True).items()}

    def _tp_copies(self) -> dict[str, int]:
        """Every state name -> how many tensor ranks hold its slice (shard_copies)."""
        return {name: shard_copies(t) for name, t in self.model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        params = [p for p in dict.fromkeys(self.model.parameters()) if p.grad is not None]
        if scaler.enabled and found_inf_anywhere(scaler, [p.grad for p in params], self.tp_comm, self.comm):
            return True, torch.tensor(float("inf"))
        total_norm = tp_square_sum([(p.grad, p) for p in params], self.tp_comm).sqrt()
        scale_to_norm([p.grad for p in params], total_norm, max_norm)
        return False, total_norm

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        dims, copies = self._tp_dims(), self._tp_copies()
        state = super().model_state_dict()
        return {name: t if dims[name] is None else gather_full(t, dims[name], self.tp_comm, copies[name])
                for name, t in state.items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        dims, copies = self._tp_dims(), self._tp_copies()
        super().load_model_state_dict({name: t if dims.get(name) is None
                                       else slice_full(t, dims[name], self.tp_comm, copies[name])
                                       for name, t in state.items()})

    def _map_optimizer_tensors(self, state: dict, change) -> dict:
        dims, copies = self._tp_dims(), self._tp_copies()
        per_param = {name: {key: change(v, dims[name], copies[name]) if isinstance(v, torch.Tensor) and v.ndim > 0
                            and dims.get(name) is not None else v for key, v in entry.items()}
                     for name, entry in state["state"].items()}
        return {**state, "state": per_param}

    def optimizer_state_dict(self) -> dict:
        return self._map_optimizer_tensors(super().optimizer_state_dict(),
                                           lambda t, dim, copies: gather_full(t, dim, self.tp_comm, copies))

    def load_optimizer_state_dict(self, state: dict) -> None:
        super().load_optimizer_state_dict(self._map_optimizer_tensors(
            state, lambda t, dim, copies: slice_full(t, dim, self.tp_comm, copies).clone()))

    def num_params(self) -> int:
        return sum(p.numel() * (self.tp_comm.world // shard_copies(p) if sharded_dim(p) is not None else 1)
                   for p in dict.fromkeys(self.model.parameters()))


class TensorParallelEngine(TensorParallelMixin, Engine):
    """One replica of a tensor-parallel model (train.parallel=none)."""

    def __init__(self, model, optimizer, tp_comm: Collectives):
        super().__init__(model, optimizer)
        self.tp_comm = tp_comm


class TensorParallelDDPEngine(TensorParallelMixin, DDPEngine):
    """Replicas of a tensor-parallel model, gradients averaged over the dp group (train.parallel=ddp)."""

    def __init__(self, model, optimizer, comm: Collectives, bucket_mb: float, tp_comm: Collectives):
        self.tp_comm = tp_comm
        super().__init__(model, optimizer, comm, bucket_mb)


class TensorParallelZeroEngine(TensorParallelMixin, ZeroEngine):
    """Replicas of a tensor-parallel model whose states ZeRO (stage 1, 2 or 3) shards over the dp
    group (train.parallel=zero1, zero2, zero3)."""

    def __init__(self, model, make_optimizer, weight_decay_groups, comm: Collectives, stage: int,
                 working_dtype: torch.dtype, tp_comm: Collectives):
        self.tp_comm = tp_comm
        super().__init__(model, make_optimizer, weight_decay_groups, comm, stage, working_dtype)

    def _pieces(self):
        """(this rank's piece of a gradient, its parameter) for every piece this rank updates."""
        return [(unit.piece_tensors[i].grad, unit.params[i]) for unit in self.units for i, _, _ in unit.piece_list]

    @torch.no_grad()
    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        return sharded_norm_and_clip(self._pieces(), self.comm, self.tp_comm, max_norm, scaler)


class TensorParallelFSDPEngine(TensorParallelMixin, FSDPEngine):
    """Replicas of a tensor-parallel model sharded by FSDP2 over the mesh's dp dimension (train.parallel=fsdp)."""

    def __init__(self, model, make_optimizer, weight_decay_groups_of, comm: Collectives, working_dtype: torch.dtype,
                 dp_mesh, tp_comm: Collectives):
        self.tp_comm = tp_comm
        marks = {name: (sharded_dim(p), getattr(p, "tp_summed", False), shard_copies(p))
                 for name, p in model.named_parameters()}
        super().__init__(model, make_optimizer, weight_decay_groups_of, comm, working_dtype, mesh=dp_mesh)
        self.summed, self.copied = [], []
        for name, p in model.named_parameters():  # fully_shard's new parameters, under the same names
            dim, summed, copies = marks[name]
            if dim is not None:
                p.tp_dim = dim
            if summed:
                self.summed.append(p)
            if copies > 1:
                p.tp_copies = copies
                self.copied.append(p)

    def finish_gradients(self) -> None:
        super().finish_gradients()
        for p in self.summed:  # each tp rank's dp shard of its partial gradient: the sum is over tp
            if p.grad is not None:
                self.tp_comm.all_reduce(local(p.grad), kind="tp")
        for p in self.copied:  # a replicated KV head's: over its copies (tp.py's hook, lost)
            if p.grad is not None:
                shard = local(p.grad)
                shard.copy_(sum_over_copies(shard, self.tp_comm, p.tp_copies))

    @torch.no_grad()
    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        pieces = [(local(p.grad), p) for p in self.model.parameters() if p.grad is not None]
        return sharded_norm_and_clip(pieces, self.norm_comm, self.tp_comm, max_norm, scaler)
