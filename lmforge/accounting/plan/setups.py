"""From `lmforge plan`'s options to plans: one setup, every combination of several (--compare), or the
one a search finds (--solve: the largest micro-batch, or the fewest devices, that fit).

The plans themselves are arithmetic (make.py for training, inference.py for serving); this module
reads the options, checks them (one LmforgeError line each, before anything is written), measures
this machine when `--hardware this` asks for it, and searches.
"""

import itertools

from lmforge.accounting.inference import PREFILL_DTYPE
from lmforge.accounting.plan.inference import InferenceSetup, make_inference_plan
from lmforge.accounting.plan.make import Setup, make_plan
from lmforge.accounting.shapes import tensor_parallel_degrees
from lmforge.config import Config
from lmforge.common.errors import LmforgeError
from lmforge.modes.parallel import get_strategy

# The options that take several comma-separated values with --compare, and the type of each value.
LISTS = {"batch_size": int, "seq_len": int, "precision": str, "optimizer": str, "zero_stage": int, "dp": int,
         "tp": int, "cp": int, "pp": int, "recompute": str, "attention": str, "hardware": str, "weights": str, "kv_dtype": str}
TRAINING_ONLY = ("grad_accum", "precision", "optimizer", "zero_stage", "dp", "dp_shard", "dp_replicate", "cp", "pp",
                 "recompute", "attention",
                 "fp32_attention", "sequence_parallel", "tokens", "price_per_hour")
INFERENCE_ONLY = ("weights", "group_size", "kv_dtype")
MAX_TP = 8  # tensor parallelism stays inside one node's NVLink domain (Narayanan et al. 2021, section 3.3)
MAX_DP = 4096


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_setups(cfg: Config, args, trace=None) -> tuple[list[dict], list[str], str]:
    """(plans, the options that vary across them, a note from --solve) for `lmforge plan`'s args;
    with `trace` (the trainer's one-process engine, built for roofline/trace.py) each training plan's
    step time by the roofline too (--roofline)."""
    wrong = INFERENCE_ONLY if not args.inference else TRAINING_ONLY
    given = [name for name in wrong if getattr(args, name) is not None]
    if given:
        raise LmforgeError(f"{option(given[0])} is a {'training' if args.inference else 'serving'} setting: "
                           f"{'leave it out with --inference' if args.inference else 'add --inference to use it'}")
    lists = _lists(args)
    varying = [name for name, values in lists.items() if len(values) > 1]
    if varying and not args.compare:
        raise LmforgeError(f"{option(varying[0])} {getattr(args, varying[0])}: several values need --compare")
    if args.compare and not varying:
        raise LmforgeError("--compare needs an option with several values, e.g. --zero-stage 0,1,2,3")
    if args.compare and args.solve:
        raise LmforgeError("--compare and --solve do not go together: solve one setup at a time")
    for seq_len in lists.get("seq_len", []):
        if seq_len > cfg.model.max_seq_len:
            raise LmforgeError(f"--seq-len {seq_len} is beyond the model's {cfg.model.max_seq_len} positions: "
                               f"lower it, or add model.max_seq_len={seq_len}")
    machines = Machines(args.remeasure, trace)
    plans = [_plan(cfg, args, dict(zip(lists, values)), machines) for values in itertools.product(*lists.values())]
    note = ""
    if args.solve:
        chosen = {name: values[0] for name, values in lists.items()}
        plans[0], note = (_solve_batch if args.solve == "batch" else _solve_devices)(cfg, args, chosen, machines)
    return plans, varying, note


def plan_overrides(args) -> list[str]:
    """The config overrides of `lmforge plan`, with `--pp` as what it means: train.pipeline_stages.
    With several values (--compare) the config is checked at the largest; each plan takes its own."""
    overrides = list(args.overrides)
    if args.pp is not None:
        if any(item.strip().startswith("train.pipeline_stages=") for item in overrides):
            raise LmforgeError("--pp and train.pipeline_stages say the same: give one of them")
        overrides.append(f"train.pipeline_stages={max(_lists(args)['pp'])}")
    return overrides


def _lists(args) -> dict[str, list]:
    values = {}
    for name, kind in LISTS.items():
        raw = getattr(args, name)
        if raw is None:
            continue
        try:
            values[name] = [kind(item.strip()) for item in str(raw).split(",")]
        except ValueError:
            raise LmforgeError(f"{option(name)} {raw}: each value must be an integer") from None
    return values


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

    def roofline(self, cfg, setup, plan: dict) -> dict | None:
        """The plan's step time by the roofline: on this machine's measured roof (roofline/measure.py)
        with the rates of the step's own matmul shapes (roofline/shapes.py), or a named accelerator's
        datasheet roof; --remeasure: the roof measured again once a plan, its step's shapes with it."""
        from lmforge.accounting.hardware import ACCELERATORS
        from lmforge.accounting.plan.make import strategy_of
        from lmforge.accounting.roofline import datasheet_roof
        from lmforge.accounting.roofline.ops import predict_step
        from lmforge.accounting.roofline.shapes import this_step_roof

        if setup.hardware == "this":
            remeasure, self.seen["roof"] = self.remeasure and "roof" not in self.seen, True
            roof = this_step_roof(self.device(), self.trace, cfg, setup, remeasure=remeasure)
        else:
            roof = datasheet_roof(setup.hardware, plan["time"]["peak_flops_per_device"],
                                  ACCELERATORS[setup.hardware].memory_bandwidth)
        return predict_step(self.trace, cfg, setup, roof, strategy_of(setup))

    @staticmethod
    def device():
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _plan(cfg: Config, args, chosen: dict, machines: Machines) -> dict:
    """One plan for the options chosen (one value of each LIST option) and the others in args."""
    try:
        if args.inference:
            setup = InferenceSetup(batch_size=chosen.get("batch_size", 1),
                                   seq_len=chosen.get("seq_len", cfg.model.max_seq_len),
                                   weights=chosen.get("weights", "bf16"), group_size=args.group_size or 128,
                                   kv_dtype=chosen.get("kv_dtype", "bf16"), tp=chosen.get("tp", 1),
                                   hardware=chosen.get("hardware", "this"), mfu=args.mfu,
                                   reserve_bytes=args.reserve * 2**30)
            setup.validate(cfg.model)
            machine = machines.inference(setup.weights) if setup.hardware == "this" else None
            return make_inference_plan(cfg.model, setup, machine)
        sequence_parallel = args.sequence_parallel
        if sequence_parallel is None and chosen.get("cp", cfg.parallel.cp) > 1:
            sequence_parallel = False  # the trainer's default (parallel.sequence_parallel=false); --sequence-parallel
        chosen = {**chosen, **_data_degrees(cfg, args, chosen)}
        setup = Setup.from_config(cfg, **chosen, grad_accum=args.grad_accum, sequence_parallel=sequence_parallel,
                                  fp32_attention=args.fp32_attention, mfu=args.mfu, tokens=args.tokens,
                                  price_per_hour=args.price_per_hour, reserve_bytes=args.reserve * 2**30,
                                  lora_rank=args.lora_rank, lora_targets=args.lora_targets)
        setup.validate(cfg.model)
        machine = None
        if setup.hardware == "this":
            name, peak, memory = machines.training(setup.policy.matmul_dtype)
            machine = (f"this machine: {name}", peak, memory)
        plan = make_plan(cfg.model, setup, machine)
        predicted = machines.roofline(cfg.model, setup, plan) if machines.trace is not None else None
        if predicted is not None:
            plan["roofline"] = predicted
        return plan
    except ValueError as err:
        raise LmforgeError(str(err)) from None


def _data_degrees(cfg: Config, args, chosen: dict) -> dict:
    """--dp-shard N --dp-replicate M as the plan's settings (config/degrees.py's rules): dp = N x M;
    N > 1 shards (FSDP, or the ZeRO stage given), over N ranks only when M > 1 too (hybrid sharding)."""
    if args.dp_shard is None and args.dp_replicate is None:
        return {}
    if "dp" in chosen:
        raise LmforgeError("--dp and --dp-shard/--dp-replicate say the same: give --dp-shard N --dp-replicate M "
                           "(dp = N x M) or --dp")
    shard, replicate = args.dp_shard or 1, args.dp_replicate or 1
    if shard == 1:
        return {"dp": replicate, "parallel": "ddp", "zero_stage": 0}
    stage = chosen.get("zero_stage", get_strategy(cfg.train.parallel).zero_stage)
    if cfg.train.parallel == "fsdp" or "zero_stage" not in chosen and cfg.train.parallel in ("none", "ddp"):
        return {"dp": shard * replicate, "parallel": "fsdp", "zero_stage": 3, "dp_replicate": replicate}
    if replicate > 1:
        raise LmforgeError(f"--dp-replicate {replicate} x --dp-shard {shard} (hybrid sharding) runs on FSDP2's "
                           f"2-D mesh, not lmforge's ZeRO: leave out --zero-stage")
    return {"dp": shard, "parallel": "none", "zero_stage": stage}


def _solve_batch(cfg: Config, args, chosen: dict, machines: Machines) -> tuple[dict, str]:
    """The largest micro-batch (--inference: batch of sequences) that fits: memory grows with the
    batch, so double until it does not fit, then halve the gap."""
    def plan(batch):
        return _plan(cfg, args, {**chosen, "batch_size": batch}, machines)

    if args.inference:  # linear in the batch: the plan says it directly
        largest = plan(1)["memory"]["largest_batch"]
    else:
        low, high = 0, 1
        while high <= 2**20 and plan(high)["memory"]["fits"]:
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if plan(middle)["memory"]["fits"] else (low, middle)
        largest = low
    if largest == 0:
        return plan(1), "--solve batch: not even one sequence fits this setup (the plan above is for batch 1)"
    return plan(largest), f"--solve batch: {largest} is the largest batch that fits (one more does not)"


def _solve_devices(cfg: Config, args, chosen: dict, machines: Machines) -> tuple[dict, str]:
    """The fewest devices that fit: tp (whole heads, at most one node) for serving; dp x tp x pp for
    training (dp shrinks memory only under ZeRO), fewest devices first, then the least tp and pp."""
    m = cfg.model
    tps = [t for t in tensor_parallel_degrees(m) if t <= MAX_TP]
    if args.inference:
        candidates = [{"tp": t} for t in tps]
    else:
        # pipelines replicate whole stages: with ZeRO sharding over dp, no pipeline
        sharded = chosen.get("zero_stage", get_strategy(cfg.train.parallel).zero_stage) > 0
        pps = [p for p in range(1, m.n_layers + 1) if m.n_layers % p == 0 and not (sharded and p > 1)]
        dps = [2**i for i in range(MAX_DP.bit_length())]
        candidates = sorted(({"dp": d, "tp": t, "pp": p} for d in dps for t in tps for p in pps),
                            key=lambda c: (c["dp"] * c["tp"] * c["pp"], c["tp"], c["pp"]))
    for degrees in candidates:
        plan = _plan(cfg, args, {**chosen, **degrees}, machines)
        if plan["memory"]["fits"]:
            shown = " x ".join(f"{k} {v}" for k, v in degrees.items())
            return plan, f"--solve devices: {plan['setup']['devices']} device(s) ({shown}) is the fewest that fit"
    largest = " x ".join(f"{k} {max(c[k] for c in candidates)}" for k in candidates[0])
    raise LmforgeError(f"--solve devices: no setup up to {largest} fits; lower the batch or sequence, or "
                       "add recomputation or a higher --zero-stage")
