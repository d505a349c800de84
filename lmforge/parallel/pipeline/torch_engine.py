"""torch.distributed.pipelining's schedules behind the pipeline engine (train.pipeline_engine=torch).

The reference our schedules (pipeline/engine.py) are tested against, and an option for users: the same
stage (the cut model), the same micro-batches, PyTorch's `PipelineStage` and its `ScheduleGPipe`
or `Schedule1F1B` instead of our action lists; interleaved, one `PipelineStage` per chunk (our
`chunk_views`, stage index the virtual stage) under `ScheduleInterleaved1F1B`. Everything around
the step (replicas, tied embeddings, clipping, checkpoints) is PipelineEngine's.

Two differences from ours, both for the reference's sake: the last stage returns logits and the
loss is computed by the schedule's `loss_fn` (the plain cross-entropy: train.loss_chunk_tokens does
not apply), divided by ours' `loss_divisors` (m where every micro-batch holds as many targets; a
fine-tune's by its target counts) rather than through `scale_grads` (which would divide the
gradients by m after the sum, rounding differently and weighing a fine-tune's short responses
more). No timeline is recorded: the schedule's inside is PyTorch's.
"""

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lmforge.model.transformer import IGNORE_INDEX, cross_entropy_loss
from lmforge.parallel.pipeline.engine import PipelineEngine
from lmforge.precision.policy import autocast

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class TorchPipelineEngine(PipelineEngine):
    def __init__(self, model, stage_engine, layout, schedule: str, micro_batches: int, *args, **kwargs):
        super().__init__(model, stage_engine, layout, schedule, micro_batches, *args, **kwargs)
        stages = [PipelineStage(chunk, layout.virtual_stage(c), layout.stages * layout.chunks, self.device,
                                group=self.pipeline_group) for c, chunk in enumerate(self.chunks)]
        # the single-stage schedules take the stage, the multi-stage ones the list
        self.torch_schedule = TORCH_SCHEDULES[schedule](stages if schedule == "interleaved-1f1b" else stages[0],
                                                        micro_batches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # a micro-batch's divisor depends only on its target count (the schedule does not say which
        # micro-batch it is, and its first step computes one more loss, to infer the shapes)
        return cross_entropy_loss(logits, targets) / self._divisor_of[int((targets != IGNORE_INDEX).sum())]

    def forward_backward(self, next_batch, grad_accum: int, scaler, policy, device) -> torch.Tensor:
        batches = [next_batch() for _ in range(self.micro_batches)]  # the schedule cuts the batch again
        if self.layout.last:
            targets = [b[1] for b in batches]
            self._divisor_of = {int((y != IGNORE_INDEX).sum()): d for y, d in zip(targets, self.loss_divisors(targets))}
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        losses: list[torch.Tensor] = []
        with autocast(policy, device):
            if self.layout.first:
                self.torch_schedule.step(x)
            elif self.layout.last:
                self.torch_schedule.step(target=y, losses=losses)
            else:
                self.torch_schedule.step()
        self.measure_in_flight = False
        return sum(loss.detach() for loss in losses) if losses else torch.zeros((), device=device)
