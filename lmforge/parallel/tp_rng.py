"""Dropout under tensor parallelism: which masks the tp ranks share (Shoeybi et al. 2019, section 3,
"we maintain a separate random number generator for dropout within model parallel regions";
Megatron-LM's CudaRNGStatesTracker).

Every rank of a tp group seeds its default generator alike (train/loop.py) and draws from it in the
same order, so a dropout on activations every rank holds whole draws the same mask on every rank:
    replicated   the embedding's and each block's residual dropout (after g): the same mask, so the
                 residual stream and the parameters outside the regions stay the same on every rank.
A dropout inside a region acts on this rank's slice of the heads, and must draw a mask of its own:
    per rank     each attention core's dropout on its heads' probabilities; with sequence
                 parallelism also the embedding's and residual dropouts, which then act on this
                 rank's tokens (as Megatron-LM forks its tracker there too).
`TensorRankRng` runs such a module under a generator seeded, for that one call, with a number drawn
from the default generator (alike on every rank) plus the tp rank: the ranks' masks differ, and the
default generator advances alike on every rank. Unlike Megatron's tracker it keeps no state of its
own: recomputation (wrap.py: torch.utils.checkpoint restores the default generator before
rerunning a forward) redraws the same seed and the same masks, and a resumed run needs nothing saved.
The model's dropout sites are separate modules (model/transformer.py: `embed_dropout`,
`blocks.N.residual_dropout`, `blocks.N.attn.core`), so they are wrapped from outside, at build time.
"""

import torch
import torch.nn as nn

SEED_RANGE = 2**62  # seeds drawn below this, + the tp rank: distinct for every call and rank but by chance


def _generator(device: torch.device) -> torch.Generator:
    """The default generator dropout on `device` draws from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class TensorRankRng(nn.Module):
    """`module` (a dropout site inside a tensor-parallel region) run under a generator of this tp
    rank's: seeded with a draw of the default CPU generator (the same on every tp rank) + `rank`,
    the device's default generator put back as it was afterwards."""

    def __init__(self, module: nn.Module, rank: int):
        super().__init__()
        self.module, self.rank = module, rank

    def forward(self, x: torch.Tensor, *args, **kwargs):
        seed = int(torch.randint(SEED_RANGE, (1,)).item()) + self.rank  # a CPU draw: no device sync
        generator = _generator(x.device)
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.module(x, *args, **kwargs)
        finally:
            generator.set_state(state)

    def extra_repr(self) -> str:
        return f"tp_rank={self.rank}"


def apply_tensor_rank_rng(model: nn.Module, rank: int, sequence_parallel: bool) -> None:
    """Wrap the dropout sites of a tensor-parallel `model` (p > 0) that must draw per-rank masks
    (see the module docstring); the replicated ones keep the default generator."""
    for block in model.blocks.values():
        block.attn.core = TensorRankRng(block.attn.core, rank)
        if sequence_parallel:
            block.residual_dropout = TensorRankRng(block.residual_dropout, rank)
    if sequence_parallel:
        model.embed_dropout = TensorRankRng(model.embed_dropout, rank)
