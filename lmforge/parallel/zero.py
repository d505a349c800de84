"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5), written on collectives.

Data parallelism keeps a full copy of every model state on each of the N ranks. ZeRO partitions
them instead: each rank owns 1/N of every state and updates only that.

The trainable parameters are grouped into units (each block, and "rest"; for a model other than
lmforge's, its direct children and "rest") laid end to end in flat buffers, each rank owning 1/N
of every buffer (parallel/shards.py).

Frozen parameters (requires_grad False: a LoRA base) are in no unit: every rank keeps them whole,
as broadcast from rank 0, under every stage. They get no gradient hook, no gradient, no master
copy and no optimizer state, are never updated, so the ranks' copies stay equal, and never need
gathering. The simplest correct layout; its price is that stage 3 shards only what trains: with
LoRA the base model is whole on every rank (FSDP, fsdp.py, shards it too).

The step, for each stage (all of them shard the optimizer):
    stage 1  the optimizer states (AdamW's m and v, and fp32 master weights) are sharded. Each
             rank keeps the full gradients, reduce-scatters them after backward (it needs only the
             sum of its own slice), updates its slice, and all-gathers the parameters.
    stage 2  the gradients are sharded too: as soon as backward has produced all of a unit's
             gradients (a post-accumulate-grad hook counts them), they are reduce-scattered
             asynchronously into this rank's gradient shard and freed, while backward continues.
    stage 3  the parameters are sharded too. Each block is all-gathered just before its forward
             (a forward pre-hook) and freed after it (a forward hook), gathered again before its
             backward (a backward pre-hook) and freed once its gradients are reduced; while one
             block computes, the next one's gather is already in flight (prefetch). "rest" is
             gathered when the model's forward starts and freed after its gradients are reduced.
             Freeing resizes the flat buffer's storage to 0 and gathering resizes it back, so the
             parameters (views of it) and anything autograd saved of them stay valid.

Mixed precision (bf16-mixed, fp16-mixed, fp8), the paper's layout: the parameters the model
computes with are 16-bit (2 bytes), so are their gradients (2 bytes, and the collectives move
16-bit numbers), and the K = 12 bytes of fp32 master weight, m and v per parameter are sharded
together: (2 + 2 + 12) Psi bytes before sharding. After the step each rank casts its master
slice into its 16-bit slice. Under fp32 and bf16-pure the working parameters are the master
weights (K = 8 or 4). The update itself is lmforge's AdamW (optim/adamw.py) over this rank's
pieces: the part of each parameter that falls in its slice, a view of the master shard, in the
parameter's weight-decay group; elementwise, so each element gets the same update as in one
process. Any torch optimizer works the same way (it sees plain tensors with gradients); when it
is lmforge's AdamW counting lost updates (bf16-pure), the engine adds up the ranks' counts.
Muon (optim/muon.py) needs each whole matrix for its Newton-Schulz step: the engine gathers the
blocks' Muon updates for it, one all-gather per step (parallel/whole_matrices.py).

Communication per step per rank (parallel/comm.py, accounting/comm.py): stages 1 and 2,
(N-1)/N (Psi reduce-scattered + Psi all-gathered) = 2 Psi in the limit, as much as DDP;
stage 3, (N-1)/N (2 Psi_blocks + Psi_rest gathered + Psi reduce-scattered): 3 Psi for the blocks
(the paper's figure), "rest" gathered once per forward and backward together.
"""


import torch
import torch.distributed as dist
import torch.nn as nn

from lmforge.optim.adamw import counts_lost_updates
from lmforge.optim.muon import Muon
from lmforge.accounting.measure import optimizer_state_bytes_measured, unique_storages_bytes
from lmforge.parallel.engine import Engine
from lmforge.parallel.shards import Unit, model_units, shard_groups, unit_modules
from lmforge.parallel.whole_matrices import GatheredMatrices


class ZeroEngine(Engine):
    data_parallel = grads_sharded = True

    def __init__(self, model: nn.Module, make_optimizer, weight_decay_groups, groups, stage: int,
                 working_dtype: torch.dtype):
        super().__init__(model, None, groups)
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.stage = stage
        self.broadcast_from_rank0()
        self.units, names = model_units(model, self.world_size, self.rank)
        self.unit_of = {p: unit for unit in self.units for p in unit.params}
        self.frozen = {p: name for p, name in names.items() if not p.requires_grad}  # kept whole
        master_dtype = next(iter(self.unit_of)).dtype  # what the precision policy stores (fp32 or bf16)
        self.separate_master = master_dtype != working_dtype
        for unit in self.units:
            unit.shard(stage, master_dtype, working_dtype)
        groups, self.group_names = shard_groups(self.units, weight_decay_groups, names)
        self.optimizer = make_optimizer(groups)
        if isinstance(self.optimizer, Muon):  # its matrices' updates gathered: parallel/whole_matrices.py
            muon = [p for g in weight_decay_groups if g.get("use_muon") for p in g["params"]]
            self.optimizer.whole_matrices = GatheredMatrices(self.units, muon, self.comm)
        self.sum_lost_updates = counts_lost_updates(self.optimizer)  # each rank counts its slice

        self._hooks = []
        if stage >= 2:
            self._hooks += [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.unit_of]
        if stage == 3:
            self._hook_blocks(model)

    # -- stage 3: gather before use, free after -------------------------------------------------------

    def _gather(self, unit: Unit, wait: bool = True) -> None:
        if not unit.gathered and unit.gather is None:
            unit.flat.untyped_storage().resize_(unit.padded * unit.flat.element_size())
            # evaluation and sampling forwards are not a training step's traffic
            kind = "model" if self.model.training else "eval"
            unit.gather = self.comm.all_gather(unit.flat, unit.working_shard, kind=kind, async_op=True)
        if wait and unit.gather is not None:
            unit.gather.wait()
            unit.gather, unit.gathered = None, True

    def _hook_blocks(self, model: nn.Module) -> None:
        units = {unit.name: unit for unit in self.units}
        # a unit module with nothing trainable has no unit: its (frozen) parameters are whole
        modules = {name: module for name, module in unit_modules(model).items() if name in units}
        blocks = list(modules.values())
        block_units = [units[name] for name in modules]
        rest = units.get("rest")

        def gathering(i, step):  # before block i runs (forward: step +1, backward: -1): it, then prefetch the next
            def hook(*_):
                self._gather(block_units[i])
                if 0 <= i + step < len(block_units):
                    self._gather(block_units[i + step], wait=False)
            return hook

        for i, block in enumerate(blocks):
            self._hooks.append(block.register_forward_pre_hook(gathering(i, +1)))
            self._hooks.append(block.register_forward_hook(lambda *_, unit=block_units[i]: unit.free()))
            self._hooks.append(block.register_full_backward_pre_hook(gathering(i, -1)))
        if rest is not None:
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self._gather(rest)))
            # evaluation and sampling: no backward will come to free it
            self._hooks.append(model.register_forward_hook(
                lambda *_: None if torch.is_grad_enabled() else rest.free()))

    # -- gradients --------------------------------------------------------------------------------------

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """Stage 2 and 3: once all of a unit's gradients exist, reduce-scatter them and free them."""
        unit = self.unit_of[param]
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0
        if self.syncing:
            flat = unit.flatten([p.grad for p in unit.params], unit.grad_shard.dtype)
            for p in unit.params:
                p.grad = None
            unit.reduce = (self.comm.reduce_scatter(unit.grad_shard, flat, async_op=True), flat)
        if self.stage == 3:
            unit.free()

    def finish_gradients(self) -> None:
        if self.stage == 1:  # in place: this rank's slice of the buffer receives the sum
            works = [self.comm.reduce_scatter(u.grad_shard, u.grad_flat, async_op=True) for u in self.units]
            for work in works:
                work.wait()
        else:
            for unit in self.units:
                if unit.reduce is None:
                    raise RuntimeError(f"ZeRO: unit {unit.name} was never reduced: some of its parameters "
                                       f"got no gradient in this backward")
                unit.reduce[0].wait()
                unit.reduce = None
        for unit in self.units:
            unit.grad_shard.div_(self.world_size)  # sum / N: the gradient of the global batch's mean loss
            for i, start, end in unit.piece_list:
                grad = unit.grad_shard[start - unit.lo:end - unit.lo]
                unit.piece_tensors[i].grad = grad.to(unit.master.dtype) if self.separate_master else grad

    def local_pieces(self, leave_out: nn.Parameter | None = None) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(this rank's slice of a gradient, its parameter) for every piece this rank updates, but `leave_out`'s."""
        return [(piece.grad, unit.params[i]) for unit in self.units for i, piece in unit.piece_tensors.items()
                if unit.params[i] is not leave_out]

    def step(self) -> None:
        self.optimizer.step()
        if self.sum_lost_updates:  # this rank counted its slice: add the others'
            counts = torch.tensor([self.optimizer.lost_updates, self.optimizer.updated_elements], dtype=torch.float64)
            self.comm.all_reduce(counts, kind="scalar")
            self.optimizer.lost_updates, self.optimizer.updated_elements = (int(c) for c in counts.tolist())
        for unit in self.units:
            if self.separate_master:
                unit.working_shard.copy_(unit.master)
            if self.stage < 3:  # in place: every rank's slice into everyone's buffer
                unit.gather = self.comm.all_gather(unit.flat, unit.working_shard, async_op=True)
        for unit in self.units:
            if unit.gather is not None:
                unit.gather.wait()
                unit.gather = None

    def zero_grad(self) -> None:
        for unit in self.units:
            for piece in unit.piece_tensors.values():
                piece.grad = None
            if self.stage == 1:
                unit.grad_flat.zero_()

    # -- state by name, full tensors ---------------------------------------------------------------------

    def _gather_full(self, unit: Unit, shard: torch.Tensor) -> list[torch.Tensor]:
        full = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(full, shard.contiguous(), kind="state")
        return [t.clone() for t in unit.split(full)]

    def _local_model_state(self) -> dict[str, torch.Tensor]:
        """Full master weights (fp32 under the mixed policies) under every name the model's own
        state_dict has (tied ones under both)."""
        full = {}
        for unit in self.units:
            full.update(zip(unit.params, self._gather_full(unit, unit.master)))
        return {name: full[t] if t in full else t.detach().clone()  # frozen parameters and buffers: whole
                for name, t in self.model.state_dict(keep_vars=True).items()}

    def _state_keys(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """Per param group, (per-element state names, scalar state names) of whatever optimizer this
        is (AdamW: exp_avg, exp_avg_sq and step; SGD: momentum_buffer; Muon's matrices: momentum_buffer),
        agreed by every rank: a rank may hold no piece of some group, and the gathers must match."""
        local = []
        for group in self.optimizer.param_groups:
            elements, scalars = set(), set()
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        (scalars if value.ndim == 0 else elements).add(key)
            local.append((elements, scalars))
        everyone = [None] * self.comm.world
        dist.all_gather_object(everyone, local, group=self.comm.group)
        return [tuple(tuple(sorted(set().union(*(rank[i][kind] for rank in everyone)))) for kind in (0, 1))
                for i in range(len(local))]

    def _local_optimizer_state(self) -> dict:
        """Full optimizer states by parameter name, each rank's shards gathered."""
        keys_of, scalars_of = {}, {}
        for group, names, (elements, scalars) in zip(self.optimizer.param_groups, self.group_names, self._state_keys()):
            keys_of.update(dict.fromkeys(names, elements))
            scalars_of.update(dict.fromkeys(names, scalars))
        state, scalar_values = {}, {}
        for unit in self.units:
            for key in dict.fromkeys(k for name in unit.names for k in keys_of[name]):
                shard = torch.zeros(unit.shard_numel, dtype=unit.master.dtype, device=unit.master.device)
                for i, start, end in unit.piece_list:
                    piece_state = self.optimizer.state.get(unit.piece_tensors[i])
                    if piece_state and key in piece_state:
                        shard[start - unit.lo:end - unit.lo] = piece_state[key]
                        # a count (step) is the same for every parameter stepped together: any piece's
                        scalar_values.update({k: v for k, v in piece_state.items()
                                              if torch.is_tensor(v) and v.ndim == 0})
                for name, tensor in zip(unit.names, self._gather_full(unit, shard)):
                    if key in keys_of[name]:
                        state.setdefault(name, {})[key] = tensor
        for name, per_param in state.items():
            per_param.update({k: scalar_values[k].clone() for k in scalars_of[name] if k in scalar_values})
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                  for g, names in zip(self.optimizer.param_groups, self.group_names)]
        return {"state": state, "param_groups": groups}

    def _load_local_model_state(self, state: dict[str, torch.Tensor]) -> None:
        for unit in self.units:
            full = unit.flatten([state[name] for name in unit.names], unit.master.dtype)
            unit.master.copy_(full[unit.lo:unit.hi])
            if self.separate_master:
                unit.working_shard.copy_(unit.master)
            if self.stage < 3:
                unit.flat.copy_(full)
        with torch.no_grad():
            for p, name in self.frozen.items():
                p.copy_(state[name])

    def _load_local_optimizer_state(self, state: dict) -> None:
        for unit in self.units:
            for i, start, end in unit.piece_list:
                saved = state["state"].get(unit.names[i])
                if saved is None:
                    continue
                begin = start - unit.offsets[i]
                piece = unit.piece_tensors[i]
                # a count (0-dim, on the CPU as the optimizers keep it) whole; the rest sliced to the piece
                self.optimizer.state[piece] = {
                    k: v.detach().clone().cpu() if v.ndim == 0
                    else v.reshape(-1)[begin:begin + piece.numel()].to(piece).clone()
                    for k, v in saved.items()}
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def state_bytes(self) -> dict[str, int]:
        # stage 3: the gathered buffers come and go; what persists is the shards
        shards = [u.working_shard if self.stage == 3 else u.flat for u in self.units]
        params = unique_storages_bytes([*shards, *self.frozen])
        grads = unique_storages_bytes(u.grad_flat if self.stage == 1 else u.grad_shard for u in self.units)
        return {"parameters": params, "gradients": grads,
                "master_weights": unique_storages_bytes(u.master for u in self.units) if self.separate_master else 0,
                "optimizer_states": optimizer_state_bytes_measured(self.optimizer)}
