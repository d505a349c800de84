"""Whole matrices for an optimizer that needs them (Muon, optim/muon.py) under ZeRO (parallel/zero.py).

ZeRO hands the optimizer flat pieces: the part of each parameter in this rank's slice of its
unit's buffer (parallel/shards.py). Muon's momentum is elementwise, so it stays sharded, but its
Newton-Schulz step needs the whole momentum matrix. The choice here is to gather, not to shard by
whole parameters: the layout, the gradient and parameter collectives and the checkpoint format
stay ZeRO's own, and the price is one extra all-gather per step of each unit's Muon updates
(fp32, or the master dtype), counted under the kind "optimizer" (parallel/comm.py) and by the
plan (accounting/comm.py's with_optimizer_gather, for a pipeline stage's replicas too):
(N-1)/N x 4 bytes x the unit's padded size, for the units that hold a Muon matrix (the blocks;
lmforge's "rest" holds embeddings, head and norms, which AdamW updates, so it is never gathered).
Each rank then orthogonalises the matrices it holds a piece of (a matrix split between two ranks
is orthogonalised on both: duplicated compute, no second collective) and keeps its piece of the
result. The gathered update is the one-process update of the same gradients, so the step is
the one-process step up to the order of the gradients' sums.

Adafactor, whose state is factored by rows and columns, is refused under ZeRO and FSDP before
launch (config/rules.py), and so is Muon under FSDP (its DTensor shards are not flat pieces).
"""

import torch

from lmforge.optim.muon import orthogonalize


class GatheredMatrices:
    """Set as `optimizer.whole_matrices` by the ZeRO engine: gathers each unit's Muon updates."""

    def __init__(self, units, muon_params: list[torch.Tensor], comm):
        self.comm = comm
        muon = {id(p) for p in muon_params}
        self.shape_of = {}  # piece tensor -> its whole parameter's shape
        self.units = []  # those with a Muon matrix, in the same order on every rank
        for unit in units:
            indices = [i for i, p in enumerate(unit.params) if id(p) in muon]
            if indices:
                self.units.append((unit, indices))
            for i, piece in unit.piece_tensors.items():
                self.shape_of[id(piece)] = unit.params[i].shape

    def orthogonalize(self, pieces: list[torch.Tensor], updates: list[torch.Tensor], group: dict):
        """(each piece's part of its orthogonalised matrix, each piece's whole matrix shape)."""
        update_of = {id(p): u for p, u in zip(pieces, updates)}
        result = {}
        for unit, indices in self.units:  # every rank gathers every such unit: the collectives match
            shard = torch.zeros(unit.shard_numel, dtype=unit.master.dtype, device=unit.master.device)
            mine = [(i, start, end) for i, start, end in unit.piece_list if i in indices]
            for i, start, end in mine:
                piece = unit.piece_tensors[i]
                if id(piece) in update_of:
                    shard[start - unit.lo:end - unit.lo] = update_of[id(piece)]
            full = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
            self.comm.all_gather(full, shard, kind="optimizer")
            for i, start, end in mine:
                whole = full[unit.offsets[i]:unit.offsets[i + 1]].view(unit.params[i].shape)
                ortho = orthogonalize(whole, group["ns_coefficients"], group["ns_steps"])
                begin = start - unit.offsets[i]
                result[id(unit.piece_tensors[i])] = ortho.reshape(-1)[begin:begin + end - start]
        return [result[id(p)] for p in pieces], [self.shape_of[id(p)] for p in pieces]
