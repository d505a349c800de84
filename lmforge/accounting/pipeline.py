"""Pipeline parallelism by the numbers: how the layers are cut into stages, the bubble, and how
many micro-batches of activations each stage holds (Huang et al. 2019, GPipe; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2).

A step of m micro-batches through p stages, each stage taking t_f and t_b per micro-batch for its
forward and backward, lasts (m + p - 1)(t_f + t_b) under GPipe and 1F1B alike: the last stage
cannot start before p - 1 forwards have passed, and the first waits as long for the last backward.
Of that time each stage computes m(t_f + t_b), so the idle fraction, the bubble, is

    (p - 1) / (m + p - 1)

Stages that cost unequal time make it worse: the pipeline runs at its slowest stage's pace, and
the plan takes a step to last (m + p - 1) x the slowest stage's time per micro-batch
(accounting/plan/pipeline.py): exact for equal stages, an upper bound otherwise (a schedule played out with
unequal stages, tests/test_pipeline_accounting.py, ends between m and m + p - 1 slowest slots).

1F1B changes memory, not time: stage s (0-based) runs p - s warm-up forwards, then alternates, so
at most min(m, p - s) micro-batches of activations are alive on it; GPipe keeps all m until the
backwards start.

Interleaved 1F1B (section 2.2.2) cuts the layers into p v equal chunks, rank s holding chunks
s, s + p, ...: a chunk's forward and backward take (t_f + t_b) / v, the fill and drain (p - 1) of
those, so the step lasts (v m + p - 1)(t_f + t_b) / v and the bubble is

    (p - 1) / (v m + p - 1)          (p - 1) / (v m) of the ideal m (t_f + t_b); v = 1: 1F1B's

Rank s holds min(2 (p - s - 1) + (v - 1) p + 1, m v) chunk activations at once (its warm-up,
parallel/pipeline/schedules.py), each 1/v of its layers' (about p + (p - 1)/v micro-batches' worth
on rank 0, against 1F1B's p), and sends v times as many activations and gradients (a micro-batch
crosses every rank v times).

How the model is cut (parallel/pipeline/engine.py): stage s holds the blocks stage_layers(split)[s], the
first stage also the token (and learned position) embeddings, the last the final norm, LM head
and loss; with tied embeddings the first and the last stage each hold a full copy of the shared
matrix. Pipelines replicate whole stages for data parallelism, DDP-style or with ZeRO-1 (each
stage's optimizer states sharded over its replicas); ZeRO-2, ZeRO-3 and FSDP do not combine
(config/rules.py's PIPELINE_REFUSED says why).
"""

import bisect
import functools
import itertools
import json
import math
from dataclasses import asdict, dataclass

from lmforge.accounting.comm import communication, element_bytes, with_optimizer_gather
from lmforge.accounting.shapes import forward_flops_breakdown
from lmforge.accounting.shapes import tensor_rank_shape
from lmforge.config import ModelConfig
from lmforge.model.transformer import meta_model
from lmforge.modes import Policy, parse_split
from lmforge.optim.muon import is_hidden_matrix


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle share of a pipeline step (GPipe and 1F1B: v = 1 chunk per rank)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def chunks_in_flight(schedule: str, stages: int, micro_batches: int, stage: int, chunks: int = 1) -> int:
    """(micro-batch, chunk) activations stage `stage` holds at once: m for GPipe, min(m, p - stage)
    for 1F1B, the warm-up min(2 (p - s - 1) + (v - 1) p + 1, m v) interleaved."""
    if schedule == "interleaved-1f1b":
        return min(2 * (stages - stage - 1) + (chunks - 1) * stages + 1, micro_batches * chunks)
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def micro_batches_in_flight(schedule: str, stages: int, micro_batches: int, stage: int, chunks: int = 1) -> float:
    """Micro-batches' worth of activations (of all the stage's layers) that stage `stage` holds at
    once: chunks_in_flight / v (an int with one chunk; 5.5 for p=4, v=2 on stage 0)."""
    held = chunks_in_flight(schedule, stages, micro_batches, stage, chunks)
    return held if chunks == 1 else held / chunks


def stage_costs(cfg: ModelConfig, seq_len: int, split: list[int]) -> list[float]:
    """Forward matmul FLOPs per token of each stage: its blocks, plus the LM head on the last
    (the embedding is a lookup: no matmul work)."""
    per_block, head = _block_and_head_flops(cfg, seq_len)
    return [layers * per_block + (head if stage == len(split) - 1 else 0) for stage, layers in enumerate(split)]


def _block_and_head_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward matmul FLOPs per token of one block, and of the LM head."""
    parts = forward_flops_breakdown(cfg, seq_len)
    return (sum(parts.values()) - parts["lm_head"]) / cfg.n_layers, parts["lm_head"]


def balanced_split(cfg: ModelConfig, stages: int, seq_len: int) -> list[int]:
    """Layers per stage, contiguous, that minimise the costliest stage (the pipeline runs at its
    pace). Blocks cost the same, so the search is over how many layers the last stage gives up
    to make room for the head, the rest spread as evenly as they go, earlier stages taking the
    extra layers."""
    per_block, head = _block_and_head_flops(cfg, seq_len)
    best = None
    for last in range(1, cfg.n_layers - stages + 2):
        rest, others = cfg.n_layers - last, stages - 1
        if others == 0:
            split = [last] if rest == 0 else None
        elif rest >= others:
            split = [rest // others + (1 if i < rest % others else 0) for i in range(others)] + [last]
        else:
            split = None
        if split is None:
            continue
        costliest = max(max(split[:-1], default=0) * per_block, last * per_block + head)
        key = (costliest, -last)  # ties: the later stages keep more layers
        if best is None or key < best[0]:
            best = (key, split)
    return best[1]


def pipeline_split(cfg: ModelConfig, stages: int, split_text: str, seq_len: int) -> list[int]:
    """Layers per stage: `train.pipeline_split` if given (checked), else balanced by cost."""
    return parse_split(split_text, cfg.n_layers, stages) or balanced_split(cfg, stages, seq_len)


def virtual_split(cfg: ModelConfig, stages: int, chunks: int, split_text: str, seq_len: int) -> list[int]:
    """Layers per virtual stage: pipeline_split's p stages with one chunk per rank; p v equal
    chunks interleaved (config/validate.py checks that they divide the layers)."""
    if chunks == 1:
        return pipeline_split(cfg, stages, split_text, seq_len)
    return [cfg.n_layers // (stages * chunks)] * (stages * chunks)


def rank_chunks(split: list[int], stages: int, stage: int) -> list[range]:
    """The layers of each chunk rank `stage` holds, virtual stages stage, stage + p, ... of `split`."""
    return stage_layers(split)[stage::stages]


def stage_layers(split: list[int]) -> list[range]:
    """The layer indices each stage holds: [4, 4] -> [range(0, 4), range(4, 8)]."""
    starts = [sum(split[:i]) for i in range(len(split))]
    return [range(start, start + layers) for start, layers in zip(starts, split)]


# -- what each stage holds ------------------------------------------------------------------------

@dataclass(frozen=True)
class StageParameters:
    shapes: tuple  # every parameter one rank of the stage holds (the tied matrix on both end stages; tp: its slice)
    adapters: int | None = None  # with LoRA: the trainable adapter elements (`shapes` is the frozen base)
    hidden_matrices: int = 0  # elements of its trained blocks' 2-D weights: Muon's (optim/muon.py's is_hidden_matrix)
    block_units: tuple = ()  # trained elements of each block it holds (ZeRO's units: Muon's gather)

    @property
    def count(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


def stage_of_parameter(name: str, split: list[int]) -> int:
    """The stage that holds parameter `name` of the whole model (names as Transformer gives them)."""
    top = name.split(".")[0]
    if top == "blocks":  # blocks.<layer>...: the first stage whose layers end after it
        return bisect.bisect_right(list(itertools.accumulate(split)), int(name.split(".")[1]))
    if top in ("tok_embeddings", "pos_embeddings"):
        return 0
    if top in ("norm", "lm_head"):
        return len(split) - 1
    raise ValueError(f"accounting/pipeline.py does not know which stage holds the parameter {name}: add it "
                     f"to stage_of_parameter")


def stage_parameters(cfg: ModelConfig, split: list[int], lora_rank: int | None = None,
                     lora_targets: str = "", tp: int = 1) -> tuple[StageParameters, ...]:
    """The parameters one rank of each stage holds, read from the model built on the meta device:
    with tp > 1 a tensor rank's shapes, by name (shapes.py's tensor_rank_shape: the split matrices'
    slices, the norm gains and other whole tensors whole). A tied matrix is held by the first and by
    the last stage (once where they are one stage)."""
    return _stage_parameters(json.dumps(asdict(cfg), sort_keys=True), tuple(split), lora_rank, lora_targets, tp)


@functools.lru_cache(maxsize=64)  # --solve and --compare plan the same stages many times
def _stage_parameters(values: str, split: tuple, lora_rank: int | None, lora_targets: str, tp: int) -> tuple:
    cfg = ModelConfig(**json.loads(values))
    held: list[dict] = [{} for _ in split]  # per stage: tensor -> (shape, trainable)
    hidden = [0 for _ in split]  # per stage: elements of the trained hidden matrices
    blocks: list[dict] = [{} for _ in split]  # per stage: "blocks.N" -> its trained elements
    stage_of = {}  # by the name's first two parts: "blocks.7", "lm_head.weight"
    for name, tensor, whole, trainable in _named_parameters(values, lora_rank, lora_targets):
        shape = tensor_rank_shape(name, whole, cfg, tp)
        prefix = ".".join(name.split(".")[:2])
        if prefix not in stage_of:
            stage_of[prefix] = stage_of_parameter(name, list(split))
        if tensor not in held[stage_of[prefix]] and trainable and is_hidden_matrix(name, shape):
            hidden[stage_of[prefix]] += math.prod(shape)
        if tensor not in held[stage_of[prefix]] and trainable and prefix.startswith("blocks."):
            blocks[stage_of[prefix]][prefix] = blocks[stage_of[prefix]].get(prefix, 0) + math.prod(shape)
        held[stage_of[prefix]][tensor] = (shape, trainable)
    result = []
    for tensors, matrices, units in zip(held, hidden, blocks):
        if lora_rank is None:
            result.append(StageParameters(tuple(shape for shape, _ in tensors.values()), None, matrices,
                                          tuple(units.values())))
        else:
            base = tuple(shape for shape, trainable in tensors.values() if not trainable)
            adapters = sum(math.prod(shape) for shape, trainable in tensors.values() if trainable)
            result.append(StageParameters(base, adapters, matrices, tuple(units.values())))
    return tuple(result)


@functools.lru_cache(maxsize=16)
def _named_parameters(values: str, lora_rank: int | None, lora_targets: str) -> tuple:
    """(name, tensor index, shape, trainable) of every parameter name of the model, a tied tensor
    under each of its names (the same index)."""
    model = meta_model(ModelConfig(**json.loads(values)))
    if lora_rank is not None:
        from lmforge.model.lora import apply_lora

        apply_lora(model, lora_targets, lora_rank)
    index: dict[int, int] = {}
    return tuple((name, index.setdefault(id(tensor), len(index)), tuple(tensor.shape), tensor.requires_grad)
                 for name, tensor in model.named_parameters(remove_duplicate=False))


def stage_communication(params: StageParameters, dp: int, policy: Policy, zero_stage: int = 0,
                        optimizer: str = "adamw") -> dict:
    """One stage's gradient reduction among its dp replicas, per rank per step, in
    comm.step_communication's terms: an all-reduce (ddp), or ZeRO-1's reduce-scatter of the
    gradients and all-gather of the parameters (zero_stage 1), 2 x the elements either way (a ring
    sends (N-1)/N of them), of the parameters one rank of the stage holds (`params`, a tensor
    rank's with tp: stage_parameters). Muon under ZeRO-1 also gathers the stage's blocks
    (comm.with_optimizer_gather)."""
    trained = params.count if params.adapters is None else params.adapters
    ring = 2 * trained if dp > 1 else 0
    strategy = "zero1" if zero_stage == 1 else "ddp" if dp > 1 else "none"
    sent = communication(strategy, dp, element_bytes(strategy, policy), ring, ring)
    return with_optimizer_gather(sent, list(params.block_units), strategy, dp, policy, params.adapters is not None,
                                 optimizer)
