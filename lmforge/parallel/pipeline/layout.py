"""Where each rank of a pipeline run sits, and what its stage holds.

    rank = replica * p + stage          p = train.pipeline_stages; with more ranks than p, the
                                        pipelines are replicated (data parallel across replicas)

Stage s holds a contiguous range of blocks (accounting/pipeline.py splits them by cost or as
train.pipeline_split says); the first also holds the embedding, the last the final norm, the LM head
and the loss. A stage is the model with the other pieces removed (`cut_stage`): parameter names
stay those of the whole model, so checkpoints are keyed as in one process.
"""

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from lmforge.accounting.pipeline import pipeline_split, stage_layers


@dataclass(frozen=True)
class PipelineLayout:
    """Where this rank sits: its stage in the pipeline, and which replica of the pipeline."""
    stages: int
    replicas: int
    stage: int
    replica: int

    @classmethod
    def of(cls, rank: int, world_size: int, stages: int) -> "PipelineLayout":
        return cls(stages, world_size // stages, rank % stages, rank // stages)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline."""
        return self.replica * self.stages + stage


def pipeline_place(cfg, rank: int, world_size: int) -> tuple[PipelineLayout, range]:
    """(this rank's PipelineLayout, the layers its stage holds)."""
    layout = PipelineLayout.of(rank, world_size, cfg.train.pipeline_stages)
    split = pipeline_split(cfg.model, layout.stages, cfg.train.pipeline_split, cfg.seq_len)
    return layout, stage_layers(split)[layout.stage]


def new_groups(layout: PipelineLayout):
    """(this pipeline's ranks, this stage's replicas, this pipeline's first and last stage) as
    process groups. Every rank must create every group, in the same order (torch.distributed's rule)."""
    p, n = layout.stages, layout.replicas
    mine = {}
    for replica in range(n):
        group = dist.new_group([replica * p + s for s in range(p)])
        if replica == layout.replica:
            mine["pipeline"] = group
    for stage in range(p):
        group = dist.new_group([replica * p + stage for replica in range(n)])
        if stage == layout.stage:
            mine["data"] = group
    for replica in range(n):
        group = dist.new_group([replica * p, replica * p + p - 1])
        if replica == layout.replica:
            mine["tied"] = group
    return mine["pipeline"], mine["data"], mine["tied"]


def cut_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
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
