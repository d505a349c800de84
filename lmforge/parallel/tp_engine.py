"""What tensor parallelism (parallel/tp.py) changes in every engine (parallel/engine.py reads
these when the mesh's `tp_comm` is set; no engine class of its own):

  - the gradient norm: a sharded parameter's squares are summed over the tp group, a whole one
    (norms, row-parallel biases: the same gradient on every tp rank) counted once (`tp_square_sum`);
  - fp16's found-inf: a max over the tp group and the data-parallel one (`found_inf_anywhere`);
  - state by parameter name with full tensors (engine.py's contract): the shards are all-gathered
    along their `tp_dim` to save and sliced again to load (`whole_over_tp`),
    so a checkpoint of a tp=2 run loads in one process, and the other way round;
  - Muon's matrices gathered whole over the tp group (`TensorParallelMatrices`);
  - the parameter count of the whole model.

Every tp rank draws the same batch: `replica` / `replicas` are the data-parallel ones (the data-
parallel engine's comm is over the dp group; strategy none has one replica), and the loader shards by them.

ZeRO over the dp group (one device mesh, dp x tp; torchtitan's order: tensor parallelism first,
then data-parallel sharding of what each tensor rank holds): each tp rank's local shards are laid
in ZeRO's flat units and those sharded over its dp peers, the ranks of the same tp index
(parallel/zero.py unchanged: it sees a model of smaller matrices and a group of dp ranks). So a
rank holds 1/(tp dp) of a split matrix's states and 1/dp of a whole one's (norm gains). FSDP2
the same way: `fully_shard` over the mesh's dp dimension, applied after the tensor-parallel split
(torchtitan's order); it replaces every parameter, so fsdp.py puts `tp_dim` and `tp_copies` back
on the new ones by name, and sums over tp, after backward, the gradients that tp.py's hooks (lost
with the old parameters) would have summed.
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lmforge.optim.muon import Muon, orthogonalize
from lmforge.parallel.comm import Collectives
from lmforge.parallel.tp import shard_copies, sharded_dim
from lmforge.parallel.tp_ops import all_gather_along


def gather_full(shard: torch.Tensor, dim: int, comm: Collectives, copies: int = 1,
                kind: str = "state") -> torch.Tensor:
    """The whole tensor whose rank-r slice along `dim` is rank r's `shard` (with `copies` > 1, ranks
    r .. r + copies - 1 hold the same slice: a replicated KV head, kept once); counted under `kind`."""
    full = all_gather_along(shard.detach(), dim, comm, kind)
    if copies > 1:  # rank order: each slice `copies` times in a row
        full = torch.cat(full.chunk(comm.world, dim)[::copies], dim)
    return full.contiguous()


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
def found_inf_anywhere(scaler, grads, *comms: Collectives | None) -> bool:
    """fp16-mixed: unscale this rank's gradients; True if any rank of the groups `comms` (the tp
    group and the data-parallel one, those not None: with them, every rank of the run) found an
    inf or NaN. Every rank must skip the same steps: a rank skipping alone would keep its slice
    (or its copy of a whole parameter) while the others step, and the ranks' loss scales would
    part. A max of one number over each group."""
    device = grads[0].device if grads else None  # the group's device (NCCL reduces CUDA tensors)
    found = torch.tensor(float(scaler.unscale_([SimpleNamespace(grad=g) for g in grads])), device=device)
    for comm in comms:
        if comm is not None:
            comm.all_reduce(found, op=dist.ReduceOp.MAX, kind="scalar")
    return bool(found.item())


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


def whole_over_tp(model, state: dict, tp_comm: Collectives | None, gather: bool, optimizer: bool = False) -> dict:
    """A model state by name ({name: tensor}), or with `optimizer` an optimizer's ({"state": {name:
    {key: tensor}}, "param_groups"}): gather=True, this tp rank's slices made whole along the
    dimension each tensor is split along (to save); False, whole tensors cut to this rank's slices
    (to load). Unsplit tensors, counts (0-dim: the same on every tp rank) and other values as they
    are, and everything without tensor parallelism."""
    if tp_comm is None:
        return state
    layout = {name: (sharded_dim(t), shard_copies(t)) for name, t in model.state_dict(keep_vars=True).items()}

    def change(t, name):
        dim, copies = layout.get(name, (None, 1))
        if not isinstance(t, torch.Tensor) or t.ndim == 0 or dim is None:
            return t
        return gather_full(t, dim, tp_comm, copies) if gather else slice_full(t, dim, tp_comm, copies).clone()
    if not optimizer:
        return {name: change(t, name) for name, t in state.items()}
    per_param = {name: {key: change(v, name) for key, v in entry.items()} for name, entry in state["state"].items()}
    return {**state, "state": per_param}
