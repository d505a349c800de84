"""The engines of a tensor-parallel model (parallel/tp.py): strategy none (one replica) or ddp over
the data-parallel group (parallel/mesh.py), with what tensor parallelism changes in them:

  - the gradient norm: a sharded parameter's squares are summed over the tp group, a whole one
    (norms, row-parallel biases: the same gradient on every tp rank) counted once;
  - state by parameter name with full tensors (engine.py's contract): the shards are all-gathered
    along their `tp_dim` to save and sliced again to load, so a checkpoint of a tp=2 run loads in
    one process, and the other way round;
  - the parameter count of the whole model.

Every tp rank draws the same batch: `replica` / `replicas` are the data-parallel ones (DDP's comm is
over the dp group; strategy none has one replica), and the loader shards by them.
"""

import torch

from lmforge.optim.clip import scale_to_norm
from lmforge.parallel.comm import Collectives
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.engine import Engine
from lmforge.parallel.tp import shard_copies, sharded_dim


def gather_full(shard: torch.Tensor, dim: int, comm: Collectives, copies: int = 1) -> torch.Tensor:
    """The whole tensor whose rank-r slice along `dim` is rank r's `shard` (with `copies` > 1, ranks
    r .. r + copies - 1 hold the same slice: a replicated KV head, kept once)."""
    parts = shard.detach().movedim(dim, 0).contiguous()
    full = parts.new_empty((comm.world * parts.shape[0], *parts.shape[1:]))
    comm.all_gather(full, parts, kind="state")
    if copies > 1:  # rank order: each slice `copies` times in a row
        full = full.unflatten(0, (comm.world, parts.shape[0]))[::copies].flatten(0, 1)
    return full.movedim(0, dim).contiguous()


def slice_full(full: torch.Tensor, dim: int, comm: Collectives, copies: int = 1) -> torch.Tensor:
    return full.chunk(comm.world // copies, dim=dim)[comm.rank // copies]


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
        # fp16-mixed (a loss scaler) is refused with tensor parallelism by parallel/launch.py
        params = [p for p in dict.fromkeys(self.model.parameters()) if p.grad is not None]
        # a slice held by several ranks (a replicated KV head) is summed over them: counted once
        squares = [torch.linalg.vector_norm(p.grad, dtype=torch.float32).square() / shard_copies(p) for p in params]
        sharded = sum((s for s, p in zip(squares, params) if sharded_dim(p) is not None), torch.zeros(()))
        self.tp_comm.all_reduce(sharded, kind="scalar")
        whole = sum((s for s, p in zip(squares, params) if sharded_dim(p) is None), torch.zeros(()))
        total_norm = (sharded + whole).sqrt()
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
