"""FSDP2: PyTorch's `fully_shard`, the path to run at scale (what parallel/zero.py's stage 3 does,
in C++-backed DTensors, with its own streams and prefetching).

`fully_shard` is applied to each unit module (parallel/shards.py's `unit_modules`: lmforge's
blocks, or any other model's direct children; one that shares a parameter with another is left to
the model's group) and then to the whole model (whose own group is then the embeddings, final norm
and head: the same units as zero.py). Parameters become DTensors sharded
on dim 0; each group is all-gathered before its forward and backward and resharded after, and its
gradients reduce-scattered. The MixedPrecisionPolicy follows the precision policy as zero.py's
layout does: under bf16-mixed, fp16-mixed and fp8 the gathered parameters and the reduced
gradients are 16-bit, the sharded parameters (the master weights) and AdamW's m and v fp32.
lmforge's AdamW steps the sharded parameters directly (its foreach operations run on DTensors),
as any torch optimizer does. Frozen parameters (a LoRA base) are sharded and gathered like the
others; only the trainable ones get gradients and optimizer states.

A tensor-parallel model (parallel/tp_engine.py): `fully_shard` replaces every parameter, so the
engine puts `tp_dim` and `tp_copies` back on the new ones by name, and sums over tp, after
backward, the gradients that tp.py's hooks (lost with the old parameters) would have summed: the
whole parameters' (norms) over every tp rank, a replicated KV head's over its copies (tp.py's
sum_over_copies, on each rank's dp shard).
"""

import contextlib

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.model.lora import LoRALinear
from lmforge.parallel.comm import Collectives
from lmforge.accounting.measure import optimizer_state_bytes_measured, unique_storages_bytes
from lmforge.parallel.engine import Engine
from lmforge.parallel.shards import parameter_units, unit_modules
from lmforge.parallel.tp import shard_copies, sharded_dim, sum_over_copies

FULL = StateDictOptions(full_state_dict=True)


def compiled(model) -> bool:
    """train.compile wrapped the blocks (wrap.py)."""
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())


def renamed(model) -> bool:
    """The model's state_dict names are not its parameters' (compile's wrappers; LoRA, whose hooks
    drop the `.base` of a wrapped weight: model/lora.py), which torch's set_model_state_dict
    does not map: its full tensors would be copied into the sharded ones unsharded."""
    return compiled(model) or any(isinstance(m, LoRALinear) for m in model.modules())


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FSDPEngine(Engine):
    data_parallel = grads_sharded = True
    counts_model_traffic = False  # fully_shard's all-gathers and reduce-scatters are its own

    def __init__(self, model, make_optimizer, weight_decay_groups_of, groups, working_dtype: torch.dtype):
        """Sharded over `groups.fsdp_mesh`: the 1-D mesh of the engine's `comm` (the dp or dp x cp
        ranks), or the 2-D (dp_replicate, dp_shard) one of hybrid sharding (HSDP: fully_shard
        shards over dp_shard and all-reduces the gradients over dp_replicate; the norm's squares
        are then summed over a shard group only)."""
        super().__init__(model, None, groups)
        self.broadcast_from_rank0()
        mesh = groups.fsdp_mesh
        marks = {name: (sharded_dim(p), getattr(p, "tp_summed", False), shard_copies(p))
                 for name, p in model.named_parameters()}
        param_dtype = None if working_dtype == next(model.parameters()).dtype else working_dtype
        # cast_forward_inputs=False: the blocks' fp32 inputs that are not activations (the rotary
        # cos/sin tables) stay fp32, as under ZeRO; autocast casts what the matmuls read
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype, cast_forward_inputs=False)
        unit_of = parameter_units(model)
        for name, module in unit_modules(model).items():
            if all(unit_of[p] == name for p in module.parameters()):  # a shared one: the model's group
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.optimizer = make_optimizer(weight_decay_groups_of(model))  # over the sharded parameters
        if mesh.ndim == 2:  # hybrid sharding: each shard held by every replicate group
            self.norm_comm = Collectives(mesh["dp_shard"].get_group())
        self.summed, self.copied = [], []  # tensor parallelism's, to sum over tp after backward
        for name, p in model.named_parameters():  # fully_shard's new parameters, under the same names
            dim, summed, copies = marks[name]
            if dim is not None:
                p.tp_dim = dim
            if summed:
                self.summed.append(p)
            if copies > 1:
                p.tp_copies = copies
                self.copied.append(p)

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def finish_gradients(self) -> None:
        for p in self.summed:  # each tp rank's dp shard of its partial gradient: the sum is over tp
            if p.grad is not None:
                self.tp_comm.all_reduce(local(p.grad), kind="tp")
        for p in self.copied:  # a replicated KV head's: over its copies (tp.py's hook, lost)
            if p.grad is not None:
                shard = local(p.grad)
                shard.copy_(sum_over_copies(shard, self.tp_comm, p.tp_copies))

    def local_pieces(self, leave_out=None) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
        return [(local(p.grad), p) for p in self.model.parameters() if p.grad is not None and p is not leave_out]

    def _local_model_state(self):
        if not compiled(self.model):
            return get_model_state_dict(self.model, options=FULL)
        # compile's wrappers give canonical names in the model's own state_dict, which
        # get_model_state_dict's name lookup rejects ("Expected '_orig_mod'"): gather from that one
        return {name: t.full_tensor() if isinstance(t, DTensor) else t.detach()
                for name, t in self.model.state_dict().items()}

    def _local_optimizer_state(self):
        return get_optimizer_state_dict(self.model, self.optimizer, options=FULL)

    def _load_local_model_state(self, state):
        if not renamed(self.model):
            return set_model_state_dict(self.model, state, options=FULL)
        # as model_state_dict: each rank keeps its own slice of the full tensors (no communication)
        own = self.model.state_dict()
        self.model.load_state_dict({name: distribute_tensor(state[name].to(t.dtype), t.device_mesh, t.placements,
                                                            src_data_rank=None) if isinstance(t, DTensor)
                                    else state[name] for name, t in own.items()})

    def _load_local_optimizer_state(self, state):
        set_optimizer_state_dict(self.model, self.optimizer, state, options=FULL)

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"parameters": unique_storages_bytes(local(p) for p in params),
                "gradients": unique_storages_bytes(local(p.grad) for p in params if p.grad is not None),
                "master_weights": 0,
                "optimizer_states": optimizer_state_bytes_measured(self.optimizer)}
