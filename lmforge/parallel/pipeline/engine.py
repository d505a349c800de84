"""Pipeline parallelism: the model cut into p stages, one per rank (pipeline/layout.py), and
micro-batches flowing through.

One optimizer step (`PipelineEngine.forward_backward`): the step's m micro-batches go through the
stage's schedule (pipeline/schedules.py: GPipe, 1F1B or interleaved 1F1B, whose actions name one of
the rank's model chunks, layout.py's `chunk_views`), each forward receiving its input from the
stage before and sending its output to the stage after (point-to-point send/recv), each backward
receiving the gradient of its output and sending that of its input. Then `finish_gradients`:
  - tied embeddings (Press & Wolf 2017): the first stage embeds with the matrix, the last scores
    with it, each its own copy; their gradients are summed between the two ranks, so both copies
    take the same step, as the one shared matrix would (a frozen one, under LoRA, takes none);
  - across replicas, the stage's engine (parallelize.py's STAGE_REPLICA_ENGINES) reduces the
    gradients over the ranks holding that stage (the mesh's dp group).
The norm for clipping is summed over the stages (ZeRO-1: and each stage's shards; the tied matrix
once), the fp16 found-inf over all ranks, the loss (known on the last stage) averaged over the
replicas. The step, the state by name and the bytes held are the stage engine's, renamed and
gathered over the stages here.

Pipelines of tensor-parallel stages (parallel.tp > 1; Narayanan et al. 2021, section 3): each
stage's piece is split over its tp ranks (parallel/tp.py, before the cut), and tensor rank t of
stage s exchanges with tensor rank t of stages s +- 1 (layout.py) the activations, whole on every
tensor rank. The last stage's loss is the vocabulary-parallel one (tp_ops.py); the norm sums a
split matrix's squares over the tp group, a whole one's once (tp_engine.py), then over the stages;
the stage engine gathers whole tensors by name over the tp group (parallel/engine.py).

What it costs: every stage idles while the pipeline fills and drains, (p - 1) / (m + p - 1) of the
step (accounting/pipeline.py); the timeline (pipeline/timeline.py) measures it.
"""

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from lmforge.accounting.measure import measure_saved_bytes
from lmforge.optim.clip import clip_grad_norm, scale_to_norm
from lmforge.parallel.comm import Collectives
from lmforge.parallel.engine import Engine
from lmforge.parallel.pipeline.layout import PipelineLayout, chunk_views, new_groups
from lmforge.parallel.pipeline.schedules import peak_in_flight, schedule_actions
from lmforge.parallel.tp_engine import tp_square_sum
from lmforge.precision.policy import autocast

TIED_NAME, HEAD_NAME = "tok_embeddings.weight", "lm_head.weight"


class PipelineEngine(Engine):
    """The engine of a pipeline stage (parallel/engine.py's interface)."""

    measures_activations = True  # the first step's saved bytes, per micro-batch and alive at once

    def __init__(self, model: nn.Module, stage_engine: Engine, layout: PipelineLayout, schedule: str,
                 micro_batches: int, hidden_shape: tuple[int, ...], hidden_dtype: torch.dtype, device: torch.device,
                 tied: bool, groups, timeline=None):
        """`stage_engine`: the data-parallel engine of this stage over its replicas (the mesh's dp
        group; parallelize.py builds it); `groups`: the (pp, dp, tp) mesh's (parallel/mesh.py)."""
        assert groups.mesh.get_local_rank("pp") == layout.stage, "the layout and the mesh order the ranks alike"
        self.pipeline_group, self.data_group, self.tied_group = new_groups(layout, groups)
        super().__init__(model, None, groups)
        self.stage_engine, self.optimizer = stage_engine, stage_engine.optimizer
        self.comm = stage_engine.comm  # the gradient reduction across replicas
        self.layout, self.schedule, self.micro_batches = layout, schedule, micro_batches
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.replica, self.replicas = layout.replica, layout.replicas
        self.hidden_shape, self.hidden_dtype, self.device = hidden_shape, hidden_dtype, device
        # the matrix the first and the last stage both hold (each its own copy), when tied
        tied_copy = None
        if tied and layout.stages > 1:
            tied_copy = model.tok_embeddings.weight if layout.first else model.lm_head.weight if layout.last else None
        # the last stage saves and loads its copy under the first stage's name (the one-process name)
        self.renamed = {HEAD_NAME: TIED_NAME} if tied_copy is not None and layout.last else {}
        # counted on the first stage only (the whole matrix: tp slices of it)
        self.tied_numel = tied_copy.numel() * layout.tp if self.renamed else 0
        # whose gradient the two copies sum: none when the matrix is frozen (a LoRA base)
        self.tied_param = tied_copy if tied_copy is not None and tied_copy.requires_grad else None
        self.tied_comm = Collectives(self.tied_group) if self.tied_param is not None else None
        # bytes this rank sent point to point in training steps, by what (the plan's sent_bytes_per_step keys)
        self.p2p_sent = {"activations": 0, "activation_gradients": 0}
        self.chunks = chunk_views(model, layout)  # the schedule's (interleaved 1F1B: several per rank)
        self.actions = schedule_actions(schedule, layout.stages, micro_batches, layout.stage, layout.chunks)
        self.timeline = timeline  # None: nothing recorded
        self.measure_in_flight = True  # the first step measures the activations alive at once
        held = peak_in_flight(self.actions)  # (micro-batch, chunk) pairs; micro-batches' worth below
        self.in_flight: dict = {"micro_batches": held if layout.chunks == 1 else held / layout.chunks,
                                "chunks": held}
        self._sends: list = []

    # -- point to point ----------------------------------------------------------------------------

    # `stage` is the virtual stage sent to or received from (the stage itself with one chunk per rank);
    # the tag names the message, as two ranks exchange several kinds when interleaved (p = 2: both
    # activations and gradients, of the same shape), which a recv must not take for one another. The
    # schedules also send in the order the receiver takes (tests/test_pipeline_interleaved.py), for
    # backends that ignore tags (NCCL)
    def _send(self, tensor: torch.Tensor, stage: int, kind: str, micro: int, tag: int = 0) -> None:
        tensor = tensor.detach().to(self.hidden_dtype).contiguous()
        if micro >= 0:  # a training step's (evaluation: micro -1)
            self.p2p_sent["activations" if kind == "send_forward" else "activation_gradients"] += \
                tensor.numel() * tensor.element_size()
        with self._span(kind, micro):
            self._sends.append((dist.isend(tensor, self.layout.rank_of_virtual(stage), tag=tag), tensor))

    def _recv(self, stage: int, kind: str, micro: int, tag: int = 0) -> torch.Tensor:
        buffer = torch.empty(self.hidden_shape, dtype=self.hidden_dtype, device=self.device)
        with self._span(kind, micro):
            dist.recv(buffer, self.layout.rank_of_virtual(stage), tag=tag)
        return buffer

    def _tag(self, kind: str, micro: int, receiver: int) -> int:
        """The tag of micro-batch `micro`'s activation ("F") or gradient ("B") sent to virtual stage
        `receiver` in a training step: one per message, all above evaluation's 0."""
        return 1 + 2 * (micro * self.layout.stages * self.layout.chunks + receiver) + (kind == "B")

    def _span(self, kind: str, micro: int, chunk: int = 0):
        """A timeline record of a training step's event (evaluation, micro -1, is not recorded)."""
        recorded = micro >= 0 and self.timeline is not None
        return self.timeline.span(kind, micro, chunk) if recorded else contextlib.nullcontext()

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    # -- one step ------------------------------------------------------------------------------------

    def forward_backward(self, next_batch, grad_accum: int, scaler, policy, device) -> torch.Tensor:
        """The schedule's actions for the step's m micro-batches; returns the sum of the
        micro-batch losses, each divided by its `loss_divisors`, on the last stage (zero elsewhere)."""
        layout, m = self.layout, self.micro_batches
        batches = [next_batch() for _ in range(m)]  # every stage draws them: the loader stays in step
        divisors = self.loss_divisors([y for _, y in batches]) if layout.last else None
        saved: dict[tuple[int, int], tuple] = {}  # by (micro-batch, chunk)
        # the first step measures the bytes each micro-batch's forward saves, and the most alive at once
        alive, peak, first_micro, in_flight_bytes = {}, 0, {}, self.measure_in_flight
        loss_sum = torch.zeros((), device=device)
        dist.barrier(group=self.pipeline_group)
        if self.timeline is not None:
            self.timeline.begin_step()
        for action in self.actions:
            i, c = action.micro, action.chunk
            here = layout.virtual_stage(c)  # with one chunk per rank: the stage
            tokens, loss = layout.takes_tokens(c), layout.gives_loss(c)
            if action.kind == "F":
                x, y = batches[i]
                inputs = x if tokens else self._recv(here - 1, "recv_forward", i,
                                                     self._tag("F", i, here)).requires_grad_()
                measuring = measure_saved_bytes(self.model.parameters) if in_flight_bytes \
                    else contextlib.nullcontext()
                with self._span("forward", i, c), measuring as measured, autocast(policy, device):
                    output = self.chunks[c](inputs, y if loss else None)
                    if loss:
                        output = output / divisors[i]  # m where the micro-batches hold as many targets
                if in_flight_bytes:
                    alive[i, c] = measured.activations
                    if i == 0:  # micro-batch 0 runs first, through each chunk
                        first_micro[c] = measured.activations
                    peak = max(peak, sum(alive.values()))
                if loss:
                    loss_sum += output.detach()
                else:
                    self._send(output, here + 1, "send_forward", i, self._tag("F", i, here + 1))
                saved[i, c] = (inputs, output)
            else:
                inputs, output = saved.pop((i, c))
                if loss:
                    with self._span("backward", i, c):
                        scaler.scale(output).backward()
                else:
                    grad = self._recv(here + 1, "recv_backward", i, self._tag("B", i, here))
                    with self._span("backward", i, c):
                        output.backward(grad.to(output.dtype))
                if not tokens:
                    self._send(inputs.grad, here - 1, "send_backward", i, self._tag("B", i, here - 1))
                alive.pop((i, c), None)
        self._wait_sends()
        if in_flight_bytes:
            self.in_flight["activation_bytes"] = peak  # the most saved for backward at once
            self.in_flight["one_micro_batch_bytes"] = sum(first_micro.values())  # through all the rank's chunks
            self.in_flight["chunk_bytes"] = [first_micro[c] for c in range(layout.chunks)]
            self.measure_in_flight = False
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch through the whole pipeline, known on every stage of it."""
        layout = self.layout
        for c, chunk in enumerate(self.chunks):  # in virtual-stage order: one pass through the pipeline per chunk
            here = layout.virtual_stage(c)
            inputs = x if layout.takes_tokens(c) else self._recv(here - 1, "recv_forward", -1)
            output = chunk(inputs, y if layout.gives_loss(c) else None)
            if not layout.gives_loss(c):
                self._send(output, here + 1, "send_forward", -1)
        loss = output.float() if layout.last else torch.zeros((), device=self.device)
        self._wait_sends()
        dist.broadcast(loss, src=layout.rank_of(layout.stages - 1), group=self.pipeline_group)
        return loss

    # -- gradients, step and state: the stage engine's ----------------------------------------------

    def finish_gradients(self) -> None:
        # the tied sum first, on the full gradients: ZeRO-1's reduce-scatter leaves only slices
        if self.tied_param is not None:  # the shared matrix: the embedding's and the head's parts
            self.tied_comm.all_reduce(self.tied_param.grad, kind="tied")
        self.stage_engine.finish_gradients()

    def unscale_and_clip(self, scaler, max_norm: float) -> tuple[bool, torch.Tensor]:
        grads = [g for g, _ in self.stage_engine.local_pieces()]
        holders = [SimpleNamespace(grad=g) for g in grads]  # what the scaler and clip read
        if scaler.enabled:
            found = torch.tensor(float(scaler.unscale_(holders)), device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank skips the same steps
            if found.item():
                return True, torch.tensor(float("inf"))
        # ||g||^2 summed over the stages of this pipeline (ZeRO-1: and over each stage's shards), the
        # tied matrix once (the first stage's); with tp, a split matrix's over the tp group
        counted = self.stage_engine.local_pieces(leave_out=self.tied_param if self.layout.last else None)
        if self.tp_comm is None:
            group = None if self.stage_engine.grads_sharded else self.pipeline_group
            norm = clip_grad_norm([SimpleNamespace(grad=g) for g, _ in counted], 0.0,
                                  sum_across_ranks=lambda t: dist.all_reduce(t, group=group))
        else:  # a split matrix's squares over the tp group, a whole one's once (tp_engine.py)
            total = tp_square_sum(counted, self.tp_comm, self.device)
            if self.stage_engine.grads_sharded:
                dist.all_reduce(total, group=self.data_group)
            dist.all_reduce(total, group=self.pipeline_group)
            norm = total.sqrt()
        scale_to_norm(grads, norm, max_norm)
        return False, norm

    def step(self) -> None:
        self.stage_engine.step()

    def zero_grad(self) -> None:
        self.stage_engine.zero_grad()

    def state_bytes(self) -> dict[str, int]:
        return self.stage_engine.state_bytes()

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The loss, known on the last stages (on each of their tensor ranks): summed over all ranks
        (zero elsewhere), averaged over replicas and tensor ranks."""
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / (self.replicas * self.layout.tp)

    # -- state by parameter name: each stage its own tensors ---------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {self.renamed.get(name, name): t for name, t in self.stage_engine.model_state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.stage_engine.load_model_state_dict({name: state[self.renamed.get(name, name)]
                                                 for name in self.model.state_dict()})

    def model_names(self) -> set[str]:
        """Every name of the whole model, gathered from the stages of this pipeline."""
        return set().union(*self._gather(set(self.model_state_dict())))

    def _gather(self, value) -> list:
        values = [None] * self.layout.stages
        dist.all_gather_object(values, value, group=self.pipeline_group)
        return values

    def optimizer_state_dict(self) -> dict:
        """This stage's optimizer state, with param groups naming the parameters of every stage (in
        stage order: the order of one process)."""
        local = self.stage_engine.optimizer_state_dict()
        state = {self.renamed.get(name, name): value for name, value in local["state"].items()}
        groups = []
        for index, group in enumerate(local["param_groups"]):
            names = []
            for stage_names in self._gather([self.renamed.get(n, n) for n in group["params"]]):
                names += [n for n in stage_names if n not in names]
            groups.append({**group, "params": names})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state: dict) -> None:
        local = self.stage_engine.optimizer_state_dict()["param_groups"]
        groups = [{**saved, "params": group["params"]} for saved, group in zip(state["param_groups"], local)]
        own = {name: state["state"][self.renamed.get(name, name)] for group in local for name in group["params"]
               if self.renamed.get(name, name) in state["state"]}
        self.stage_engine.load_optimizer_state_dict({"state": own, "param_groups": groups})

    def total_over_stages(self, count: int, state: dict[str, torch.Tensor]) -> int:
        """A count of this stage's `state` summed over the stages (the tied copy once)."""
        if self.renamed and TIED_NAME in state:  # a LoRA run's state is its adapters alone
            count -= state[TIED_NAME].numel()
        return sum(self._gather(count))

    def num_params(self) -> int:
        local = self.stage_engine.num_params() - self.tied_numel  # whole tensors (tp: all its ranks' slices)
        return sum(self._gather(local))

    def merged_over_stages(self, per_stage: dict) -> dict:
        """Dicts keyed by module name (fp8 scale histories), merged from the stages."""
        return {key: value for part in self._gather(per_stage) for key, value in part.items()}
