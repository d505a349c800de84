"""The flat-buffer layout ZeRO shards over (parallel/zero.py): units, their buffers and this rank's slices.

Units. The trainable parameters are grouped into units that are flattened, sharded and
communicated together: each unit module (`unit_modules`: lmforge's blocks `blocks.0` ...
`blocks.L-1`, or any other model's direct children) is a unit, and everything else (lmforge's
embeddings, final norm, head; a parameter shared by two unit modules) is the unit "rest". Frozen
parameters (requires_grad False, e.g. a LoRA base) are in no unit: see parallel/zero.py. A unit's
parameters are laid end to end in one flat buffer,
padded to a multiple of N, and rank r owns the slice [r S, (r+1) S) of it, S = ceil(numel / N).
Parameters become views of that buffer, so a collective on the buffer moves all of them at once.

Per unit, after `Unit.shard`:
    flat            the working parameters (16-bit under the mixed policies), full; under stage 3
                    its storage exists only while gathered
    working_shard   this rank's slice of it (stage 3: a copy that persists)
    master          this rank's slice of the master weights (fp32 under the mixed policies; else
                    `working_shard` itself)
    grad_flat       stage 1: the full gradients, `param.grad` views of it
    grad_shard      this rank's slice of the summed gradients
    piece_tensors   parameter index -> the part of that parameter in this rank's slice, a view of
                    `master`: what the optimizer updates
"""

import itertools

import torch
import torch.nn as nn



class Unit:
    """Parameters sharded and communicated together (one block, or "rest")."""

    def __init__(self, name: str, params: list[nn.Parameter], names: list[str], world: int, rank: int):
        self.name, self.params, self.names = name, params, names
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # where each parameter starts
        self.shard_numel = -(-self.offsets[-1] // world)  # S = ceil(numel / N)
        self.padded = self.shard_numel * world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.ready = 0  # gradients complete in this backward
        self.reduce = None  # (work, input buffer) of the reduce-scatter in flight
        self.gather = None  # the all-gather in flight (stage 3)
        self.gathered = True

    def pieces(self):
        """(parameter index, start, end) in the flat buffer, for each part of a parameter in this rank's slice."""
        for i in range(len(self.params)):
            start, end = max(self.offsets[i], self.lo), min(self.offsets[i + 1], self.hi)
            if start < end:
                yield i, start, end

    def flatten(self, tensors, dtype) -> torch.Tensor:
        """The tensors end to end, padded to N S elements."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for i, t in enumerate(tensors):
            flat[self.offsets[i]:self.offsets[i + 1]].copy_(t.reshape(-1))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[self.offsets[i]:self.offsets[i + 1]].view(p.shape) for i, p in enumerate(self.params)]

    def shard(self, stage: int, master_dtype: torch.dtype, working_dtype: torch.dtype) -> None:
        """Flatten the unit, keep this rank's slice as the master shard, make the parameters views
        of the working buffer (stage 3: free it); see the module docstring."""
        separate_master = master_dtype != working_dtype
        full = self.flatten([p.detach() for p in self.params], master_dtype)
        self.flat = full.to(working_dtype) if separate_master else full
        for p, view in zip(self.params, self.split(self.flat)):
            p.data = view
        if stage == 3:  # this rank's slice persists on its own; the full buffer only while gathered
            self.working_shard = self.flat[self.lo:self.hi].clone()
            self.free()
        else:
            self.working_shard = self.flat[self.lo:self.hi]
        self.master = full[self.lo:self.hi].clone() if separate_master else self.working_shard
        if stage == 1:  # full gradients, in one buffer per unit: param.grad are views of it
            self.grad_flat = torch.zeros(self.padded, dtype=working_dtype, device=full.device)
            self.grad_shard = self.grad_flat[self.lo:self.hi]
            for p, view in zip(self.params, self.split(self.grad_flat)):
                p.grad = view
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=working_dtype, device=full.device)
        self.piece_list = list(self.pieces())
        self.piece_tensors = {i: self.master[start - self.lo:end - self.lo] for i, start, end in self.piece_list}

    def free(self) -> None:
        """Stage 3: drop the full buffer's storage (the parameters, views of it, stay valid)."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False


def unit_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules gathered, sharded and freed one at a time: lmforge's blocks ("blocks.3", the
    names modes/'s `shard_unit` gives, which accounting/ counts by), or for any other
    model its direct children that hold parameters. The model's other parameters form "rest"."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return {f"blocks.{name}": block for name, block in blocks.items()}
    return {name: child for name, child in model.named_children() if any(True for _ in child.parameters())}


def parameter_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's name in the model's state_dict (tied: the first), in its order; the state
    dict's names are the canonical ones, whatever wrapper or adapter holds the parameter."""
    names = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter):
            names.setdefault(t, name)
    return names


def parameter_units(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's unit: the unit module holding it, or "rest" (held by none, or by more than
    one: a shared parameter must be there whenever either runs)."""
    holders: dict[nn.Parameter, set[str]] = {}
    for unit, module in unit_modules(model).items():
        for p in module.parameters():
            holders.setdefault(p, set()).add(unit)
    return {p: next(iter(holders.get(p, ()))) if len(holders.get(p, ())) == 1 else "rest"
            for p in model.parameters()}


def model_units(model: nn.Module, world: int, rank: int) -> tuple[list[Unit], dict[nn.Parameter, str]]:
    """The units of the model's trainable parameters (in the state_dict's order), and every
    parameter's name."""
    unit_of, names = parameter_units(model), parameter_names(model)
    by_unit: dict[str, list] = {}
    for p in names:
        if p.requires_grad:
            by_unit.setdefault(unit_of[p], []).append(p)
    return [Unit(u, ps, [names[p] for p in ps], world, rank) for u, ps in by_unit.items()], names


def shard_groups(units: list[Unit], weight_decay_groups: list[dict],
                 names: dict[nn.Parameter, str]) -> tuple[list[dict], list[list[str]]]:
    """The optimizer's param groups over this rank's pieces, each in its parameter's weight-decay
    group, and the names of each group's whole parameters (for the state by name)."""
    unit_of = {p: unit for unit in units for p in unit.params}
    groups, group_names = [], []
    for group in weight_decay_groups:
        pieces = []
        for p in group["params"]:
            unit = unit_of[p]
            index = next(i for i, q in enumerate(unit.params) if q is p)
            if index in unit.piece_tensors:  # the part of p in this rank's slice, if any
                pieces.append(unit.piece_tensors[index])
        groups.append({**group, "params": pieces})
        group_names.append([names[p] for p in group["params"]])
    return groups, group_names
