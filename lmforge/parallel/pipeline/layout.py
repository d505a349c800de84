"""Where each rank of a pipeline run sits, and what its stage holds.

    rank = (stage * replicas + replica) * tp + tp_rank
                                        p = parallel.pp; with more ranks than p x tp, the
                                        pipelines are replicated (data parallel across replicas);
                                        with parallel.tp > 1 each stage is tensor-parallel over tp
                                        neighbouring ranks, and a stage's tensor rank t exchanges
                                        activations with tensor rank t of the stages beside it

(parallel/mesh.py's (pp, dp, cp, tp) order, torchtitan's: the stages outermost, cp = 1.)

Stage s holds a contiguous range of blocks (accounting/pipeline.py splits them by cost or as
train.pipeline_split says); the first also holds the embedding, the last the final norm, the LM head
and the loss. A stage is the model with the other pieces removed (`cut_stage`): parameter names
stay those of the whole model, so checkpoints are keyed as in one process.

Interleaved (train.schedule=interleaved-1f1b, v = train.pipeline_virtual_stages chunks per rank;
Narayanan et al. 2021, section 2.2.2): the layers are cut into p v equal chunks, the virtual
stages, and rank s holds chunks s, s + p, s + 2p, ... (round robin), so a micro-batch goes
0 -> 1 -> ... -> p-1 -> 0 -> ... through the ranks v times. The rank's model holds all its chunks'
blocks (one optimizer, one state dict); `chunk_views` gives the engine one module per chunk.
"""

import copy
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from lmforge.accounting.pipeline import rank_chunks, virtual_split


@dataclass(frozen=True)
class PipelineLayout:
    """Where this rank sits: its stage in the pipeline, and which replica of the pipeline; with
    `chunks` > 1 (interleaved), its chunk c is the virtual stage c * stages + stage."""
    stages: int
    replicas: int
    stage: int
    replica: int
    chunks: int = 1
    tp: int = 1  # tensor ranks per stage
    tp_rank: int = 0

    @classmethod
    def of(cls, rank: int, world_size: int, stages: int, chunks: int = 1, tp: int = 1) -> "PipelineLayout":
        replicas = world_size // (stages * tp)
        outer = rank // tp  # the rank's place in the (pp, dp) grid
        return cls(stages, replicas, outer // replicas, outer % replicas, chunks, tp, rank % tp)

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def takes_tokens(self, chunk: int) -> bool:
        """Whether `chunk` is the model's first (embeds tokens; no input gradient to send)."""
        return self.virtual_stage(chunk) == 0

    def gives_loss(self, chunk: int) -> bool:
        """Whether `chunk` is the model's last (the head and the loss)."""
        return self.virtual_stage(chunk) == self.stages * self.chunks - 1

    def rank_of_virtual(self, virtual_stage: int) -> int:
        """The global rank holding `virtual_stage` in this rank's pipeline."""
        return self.rank_of(virtual_stage % self.stages)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline (the same tensor rank)."""
        return (stage * self.replicas + self.replica) * self.tp + self.tp_rank


def pipeline_place(cfg, rank: int, world_size: int) -> tuple[PipelineLayout, list[int]]:
    """(this rank's PipelineLayout, the layers its stage holds: those of all its chunks)."""
    t = cfg.train
    layout = PipelineLayout.of(rank, world_size, cfg.parallel.pp, t.pipeline_virtual_stages, cfg.parallel.tp)
    split = virtual_split(cfg.model, layout.stages, layout.chunks, t.pipeline_split, cfg.seq_len)
    return layout, [layer for chunk in rank_chunks(split, layout.stages, layout.stage) for layer in chunk]


def new_groups(layout: PipelineLayout, groups):
    """(this pipeline's ranks, this stage's replicas, this pipeline's first and last stage) as
    process groups: the first two are the mesh's pp and dp lines through this rank (`groups`:
    parallel/mesh.py's ParallelGroups), the third the pp line itself with two stages. Every rank must
    create every group, in the same order (torch.distributed's rule)."""
    pipeline = groups.mesh["pp"].get_group()
    if layout.stages == 2:
        tied = pipeline
    else:  # one group per (replica, tensor rank): its first and last stage
        ends = [[PipelineLayout(layout.stages, layout.replicas, 0, r, layout.chunks, layout.tp, t).rank_of(s)
                 for s in (0, layout.stages - 1)] for r in range(layout.replicas) for t in range(layout.tp)]
        tied, _ = dist.new_subgroups_by_enumeration(ends)
    return pipeline, groups.mesh["dp"].get_group(), tied


def cut_stage(model: nn.Module, layers, first: bool, last: bool) -> nn.Module:
    """Keep, in place, the blocks of `layers` and the pieces a stage at that place needs: the
    embedding on the first stage, the final norm, head and loss on the last. A tied LM head on a
    last stage that is not the first keeps the matrix as its own parameter (the copy whose gradient
    is summed with the first stage's)."""
    for key in list(model.blocks.keys()):
        if int(key) not in layers:
            del model.blocks[key]
    if not first:
        model.tok_embeddings = model.pos_embeddings = None
    if not last:
        model.norm = model.lm_head = model.loss = None
    return model


def chunk_views(model: nn.Module, layout: PipelineLayout) -> list[nn.Module]:
    """One module per chunk of this rank (`model` itself with one chunk): the rank's blocks, in
    layer order, in `layout.chunks` equal runs (the chunks are equal: config/validate.py), each a
    view of `model` with only that run, the embedding only on the model's first chunk, the head
    only on its last. A view shares `model`'s modules (the same parameters, the wrappers applied
    to it), so the optimizer, the state dict and the gradients stay `model`'s."""
    if layout.chunks == 1:
        return [model]
    keys = sorted(model.blocks.keys(), key=int)
    size = len(keys) // layout.chunks
    views = []
    for chunk in range(layout.chunks):
        view = copy.copy(model)  # the attributes (config, hooks) shared; its own table of children:
        view._modules = dict(model._modules)
        view.blocks = nn.ModuleDict(dict(model.blocks.items()))  # cut_stage deletes from this one
        layers = {int(key) for key in keys[chunk * size:(chunk + 1) * size]}
        views.append(cut_stage(view, layers, layout.takes_tokens(chunk), layout.gives_loss(chunk)))
    return views
