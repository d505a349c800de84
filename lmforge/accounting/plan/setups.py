"""What `lmforge plan` needs beyond one plan: this machine measured once per dtype, and the two searches
of --solve (the largest micro-batch, or the fewest devices, that fit). Plain values in, plain values
out: the command's options are read in lmforge/cli/plan_options.py.
"""

from typing import Callable

from lmforge.accounting.plan.inference import PREFILL_DTYPE
from lmforge.accounting.shapes import tensor_parallel_degrees
from lmforge.config import Config, ModelConfig
from lmforge.config.rules import tp_divisibility

MAX_TP = 8  # tensor parallelism stays inside one node's NVLink domain (Narayanan et al. 2021, section 3.3)
MAX_DP = 4096


class Machines:
    """This machine's measured peak (per matmul dtype) and memory bandwidth, measured once each."""

    def __init__(self, remeasure: bool, trace=None):
        self.remeasure, self.seen, self.trace = remeasure, {}, trace

    def training(self, dtype: str) -> tuple[str, float, int]:
        from lmforge.accounting.hardware import this_device

        if ("training", dtype) not in self.seen:
            self.seen["training", dtype] = this_device(dtype, self.device(), remeasure=self.remeasure)
        return self.seen["training", dtype]

    def inference(self, weights: str) -> tuple[str, float, int, float]:
        from lmforge.accounting.hardware import this_bandwidth

        if ("inference", weights) not in self.seen:
            name, peak, memory = self.training(PREFILL_DTYPE[weights])
            bandwidth = this_bandwidth(PREFILL_DTYPE[weights], self.device(), remeasure=self.remeasure)
            self.seen["inference", weights] = (f"this machine: {name}", peak, memory, bandwidth)
        return self.seen["inference", weights]

    def roofline(self, cfg: Config, costing, plan: dict) -> dict | None:
        """The plan's step time by the roofline (`costing`: plan/make.py's Costing): on this machine's measured
        roof (roofline/measure.py) with the rates of the step's own matmul shapes (roofline/shapes.py),
        or a named accelerator's datasheet roof; --remeasure: the roof measured again once a plan, its
        step's shapes with it."""
        from lmforge.accounting.hardware import ACCELERATORS
        from lmforge.accounting.plan.make import degrees, strategy
        from lmforge.accounting.roofline import datasheet_roof
        from lmforge.accounting.roofline.ops import predict_step
        from lmforge.accounting.roofline.shapes import this_step_roof

        d = degrees(cfg, costing.dp)
        if costing.hardware == "this":
            remeasure, self.seen["roof"] = self.remeasure and "roof" not in self.seen, True
            roof = this_step_roof(self.device(), self.trace, cfg, d.dp, remeasure=remeasure)
        else:
            roof = datasheet_roof(costing.hardware, plan["time"]["peak_flops_per_device"],
                                  ACCELERATORS[costing.hardware].memory_bandwidth)
        return predict_step(self.trace, cfg, d.dp, roof, strategy(cfg, d))

    @staticmethod
    def device():
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def largest_batch(fits: Callable[[int], bool]) -> int:
    """The largest batch with fits(batch) (0: not even one): memory grows with the batch, so double
    until it does not fit, then halve the gap."""
    low, high = 0, 1
    while high <= 2**20 and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def device_candidates(model: ModelConfig, sharded: bool, inference: bool) -> list[dict]:
    """The degrees --solve devices tries, fewest devices first, then the least tp and pp: tp (whole
    heads, at most one node) for serving; dp x tp x pp for training (tp one that config/rules.py lets
    split the model; dp shrinks memory only under ZeRO, and a pipeline's replicas take no ZeRO sharding)."""
    tps = [t for t in tensor_parallel_degrees(model) if t <= MAX_TP]
    if inference:
        return [{"tp": t} for t in tps]
    tps = [t for t in tps if tp_divisibility(model, t) is None]
    pps = [p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0 and not (sharded and p > 1)]
    dps = [2**i for i in range(MAX_DP.bit_length())]
    return sorted(({"dp": d, "tp": t, "pp": p} for d in dps for t in tps for p in pps),
                  key=lambda c: (c["dp"] * c["tp"] * c["pp"], c["tp"], c["pp"]))
