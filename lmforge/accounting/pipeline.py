"""Pipeline parallelism by the numbers: how the layers are cut into stages, the bubble, and how
many micro-batches of activations each stage holds (Huang et al. 2019, GPipe; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2).

A step of m micro-batches through p stages, each stage taking t_f and t_b per micro-batch for its
forward and backward, lasts (m + p - 1)(t_f + t_b) under GPipe and 1F1B alike: the last stage
cannot start before p - 1 forwards have passed, and the first waits as long for the last backward.
Of that time each stage computes m(t_f + t_b), so the idle fraction, the bubble, is

    (p - 1) / (m + p - 1)

1F1B changes memory, not time: stage s (0-based) runs p - s warm-up forwards, then alternates, so
at most min(m, p - s) micro-batches of activations are alive on it; GPipe keeps all m until the
backwards start.
"""

from lmforge.accounting.flops import forward_flops_breakdown
from lmforge.config import ModelConfig
from lmforge.parallel_modes import parse_split


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of a pipeline step (GPipe and 1F1B)."""
    return (stages - 1) / (micro_batches + stages - 1)


def micro_batches_in_flight(schedule: str, stages: int, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once: m for GPipe, min(m, p - stage) for 1F1B."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def stage_costs(cfg: ModelConfig, seq_len: int, split: list[int]) -> list[float]:
    """Forward matmul FLOPs per token of each stage: its blocks, plus the LM head on the last
    (the embedding is a lookup: no matmul work)."""
    parts = forward_flops_breakdown(cfg, seq_len)
    per_block = (sum(parts.values()) - parts["lm_head"]) / cfg.n_layers
    costs = [layers * per_block for layers in split]
    costs[-1] += parts["lm_head"]
    return costs


def balanced_split(cfg: ModelConfig, stages: int, seq_len: int) -> list[int]:
    """Layers per stage, contiguous, that minimise the costliest stage (the pipeline runs at its
    pace). Blocks cost the same, so the search is over how many layers the last stage gives up
    to make room for the head, the rest spread as evenly as they go, earlier stages taking the
    extra layers."""
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
        key = (max(stage_costs(cfg, seq_len, split)), -last)  # ties: the later stages keep more layers
        if best is None or key < best[0]:
            best = (key, split)
    return best[1]


def pipeline_split(cfg: ModelConfig, stages: int, split_text: str, seq_len: int) -> list[int]:
    """Layers per stage: `train.pipeline_split` if given (checked), else balanced by cost."""
    return parse_split(split_text, cfg.n_layers, stages) or balanced_split(cfg, stages, seq_len)


def stage_layers(split: list[int]) -> list[range]:
    """The layer indices each stage holds: [4, 4] -> [range(0, 4), range(4, 8)]."""
    starts = [sum(split[:i]) for i in range(len(split))]
    return [range(start, start + layers) for start, layers in zip(starts, split)]
