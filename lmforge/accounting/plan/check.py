"""Composition: to be replaced by config.rules.check_composition.

What a plan refuses beyond config validation (config/validate.py, run by make_config: names, ranges,
pipeline splits, interleaving, grad_accum with a pipeline), in the trainer's terms: the settings a
launch of `devices` ranks would not combine (parallel/launch.py). One function, so that the one rule
table can take its place.
"""

from lmforge.accounting.plan.costing import strategy
from lmforge.accounting.shapes import tensor_parallel_degrees
from lmforge.common.errors import LmforgeError
from lmforge.config import Config
from lmforge.config.degrees import mesh_degrees


def check_plan(cfg: Config, devices: int) -> None:
    """LmforgeError naming the first pair of settings that do not combine on `devices` ranks."""
    d, t, m = mesh_degrees(cfg, devices), cfg.train, cfg.model
    refusals = []
    if d.pp > 1:  # what the pipeline engine (parallel/pipeline/engine.py) composes with
        refusals.append((strategy(cfg, d) not in ("none", "ddp", "zero1"),
                         f"pp {d.pp} with {strategy(cfg, d)}: a pipeline's replicas run one backward per "
                         f"micro-batch, so ZeRO-2/3 and FSDP would communicate m times a step "
                         f"(parallel/pipeline/replicas.py); use zero stage 1 or 0"))
    if d.cp > 1:  # parallel/launch.py's CP_REFUSED
        for refused, what in ((d.pp > 1, "a pipeline (--pp)"), (t.loss_chunk_tokens > 0, "the chunked loss"),
                              (cfg.seq_len < 2 * d.cp, f"a sequence shorter than 2 x cp = {2 * d.cp} tokens"),
                              (m.sliding_window is not None, "a sliding window"), (m.dropout > 0, "dropout")):
            refusals.append((refused, f"cp {d.cp} does not combine with {what} (docs/context-parallel.md)"))
    fitting = tensor_parallel_degrees(m)  # tensor parallelism splits attention by whole heads
    refusals.append((d.tp not in fitting, f"tp {d.tp} must divide the {m.n_heads} attention heads and divide the "
                                          f"{m.kv_heads} KV heads or be a multiple of them (each rank holds whole "
                                          f"heads): use one of {', '.join(map(str, fitting))}"))
    for refused, message in refusals:
        if refused:
            raise LmforgeError(message)
