"""What the roofline (accounting/roofline/) is handed from above, and its end-of-run row.

The roofline's trace runs the trainer's own model and step and the decoder's own step on fake
tensors; accounting imports no training or generation code, so its callers (`lmforge plan
--roofline`, bench/, the end of a run with train.roofline=true) hand these down.

`add_roofline` is train.roofline's row: the step time the roofline predicts for the run,
set beside the measured one in the summary. It runs after the last checkpoint is written, on a
roof already cached by `lmforge plan --roofline X.png` (nothing is measured inside training).
"""

import torch

from lmforge.accounting.plan.make import degrees, strategy
from lmforge.accounting.roofline.ops import predict_step
from lmforge.accounting.roofline.shapes import cached_step_roof
from lmforge.common.errors import warn
from lmforge.parallel.engine import Engine
from lmforge.train.setup import build


def one_process_engine(cfg):
    """The engine of a one-process run of `cfg` (train/setup.py's model and optimizer), for the trace."""
    return Engine(*build(cfg))


def decode_step(model, batch: int, context: int):
    """One step of generate()'s loop for the decode trace (accounting/roofline/decode.py): a KV cache
    of `batch` sequences holding `context` positions, and a function that feeds the newest token
    through the cached forward and picks the next one greedily."""
    from lmforge.generate.sampling import KVCache, sample_next

    cache = KVCache.for_model(model, context + 1, batch)
    feed = torch.zeros(batch, 1, dtype=torch.long, device=next(model.parameters()).device)
    return lambda: sample_next(model(feed, kv_cache=cache, start_pos=context)[:, -1], temperature=0.0)


def add_roofline(plan: dict, cfg, replicas: int, device: torch.device, estimate) -> None:
    """train.roofline: plan["roofline"] of the run on the roof cached for `device`, after training;
    no roof cached is one warning line saying how to cache one, a failure one line of `estimate`'s."""
    def predicted():
        roof = cached_step_roof(device, one_process_engine, cfg, replicas)
        if roof is None:
            warn("train.roofline: no roofline is cached for this machine; run `lmforge plan --roofline X.png` "
                 "first (it measures and caches one)")
            return None
        return predict_step(one_process_engine, cfg, replicas, roof, strategy(cfg, degrees(cfg, replicas)))

    result = estimate("the roofline's step time", predicted)
    if result is not None:
        plan["roofline"] = result
