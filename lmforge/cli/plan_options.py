"""`lmforge plan`'s options read into what lmforge/accounting/plan/ takes: a Config per setup and a
Costing. The setup flags are aliases of config keys (ALIASES), applied as `key=value` overrides are
and validated by the same code as `lmforge train`'s; the others (--dp, --hardware, --mfu, --tokens,
--price-per-hour, --reserve) are the world and the machine, which no config key holds. One setup,
every combination of several (--compare), or the one a search finds (--solve); bad input is one
LmforgeError line, before anything is written.
"""

import copy
from pathlib import Path

from lmforge.accounting.plan.make import Costing, degrees, policy, zero_stage
from lmforge.accounting.plan.inference import InferenceSetup, make_inference_plan
from lmforge.accounting.plan.make import make_plan
from lmforge.accounting.plan.setups import Machines, device_candidates, largest_batch
from lmforge.accounting.memory import OPTIMIZERS
from lmforge.common.errors import LmforgeError, lookup
from lmforge.config import Config, parse_override, set_value, validate
from lmforge.config.load import ALIASES as OLDER_NAMES
from lmforge.modes import OPTIMIZER_MODES, PARALLEL_STRATEGIES, PRECISION_ALIASES, get_strategy

# each setup flag and the config key it stands for (the flag's value applied as `key=value`)
ALIASES = {"batch_size": "train.batch_size", "seq_len": "train.seq_len", "grad_accum": "train.grad_accum",
           "precision": "train.precision", "optimizer": "optim.name", "zero_stage": "train.parallel",
           "tp": "parallel.tp", "cp": "parallel.cp", "pp": "parallel.pp", "dp_shard": "parallel.dp_shard",
           "dp_replicate": "parallel.dp_replicate", "sequence_parallel": "parallel.sequence_parallel",
           "recompute": "train.recompute", "attention": "model.attention", "fp32_attention": "train.fp32_attention",
           "lora_rank": "finetune.lora_rank", "lora_targets": "finetune.lora_targets"}
# The options that take several comma-separated values with --compare, and the type of each value.
LISTS = {"batch_size": int, "seq_len": int, "precision": str, "optimizer": str, "zero_stage": int, "dp": int,
         "tp": int, "cp": int, "pp": int, "recompute": str, "attention": str, "hardware": str, "weights": str,
         "kv_dtype": str}
TRAINING_ONLY = ("grad_accum", "precision", "optimizer", "zero_stage", "dp", "dp_shard", "dp_replicate", "cp", "pp",
                 "recompute", "attention", "fp32_attention", "sequence_parallel", "tokens", "price_per_hour")
INFERENCE_ONLY = ("weights", "group_size", "kv_dtype")


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_lists(args) -> dict[str, list]:
    """Each LIST option given, as its values; LmforgeError for a combination of options that cannot be."""
    wrong = INFERENCE_ONLY if not args.inference else TRAINING_ONLY
    given = [name for name in wrong if getattr(args, name) is not None]
    if given:
        raise LmforgeError(f"{option(given[0])} is a {'training' if args.inference else 'serving'} setting: "
                           f"{'leave it out with --inference' if args.inference else 'add --inference to use it'}")
    lists = {}
    for name, kind in LISTS.items():
        raw = getattr(args, name)
        if raw is not None:
            try:
                lists[name] = [kind(item.strip()) for item in str(raw).split(",")]
            except ValueError:
                raise LmforgeError(f"{option(name)} {raw}: each value must be an integer") from None
            if kind is int and name != "zero_stage" and min(lists[name]) < 1:
                raise LmforgeError(f"{name} must be >= 1, got {min(lists[name])}")
    varying = [name for name, values in lists.items() if len(values) > 1]
    if varying and not args.compare:
        raise LmforgeError(f"{option(varying[0])} {getattr(args, varying[0])}: several values need --compare")
    if args.compare and not varying:
        raise LmforgeError("--compare needs an option with several values, e.g. --zero-stage 0,1,2,3")
    if args.compare and args.solve:
        raise LmforgeError("--compare and --solve do not go together: solve one setup at a time")
    if args.dp is not None and (args.dp_shard is not None or args.dp_replicate is not None):
        raise LmforgeError("--dp and --dp-shard/--dp-replicate say the same: give --dp-shard N --dp-replicate M "
                           "(dp = N x M) or --dp")
    return lists


def alias_changes(args, chosen: dict) -> dict:
    """{config key: value} that the setup flags given say, with `chosen` (one value of each LIST
    option) for the LIST ones; LmforgeError where a `key=value` on the command line sets the same key."""
    overridden = {OLDER_NAMES.get(key, key): value for key, value in map(parse_override, args.overrides)}
    changes = {}
    for name, key in ALIASES.items():
        value = chosen.get(name, None if name in LISTS else getattr(args, name))
        if value is None:
            continue
        if name == "zero_stage":
            if value not in (0, 1, 2, 3):
                raise LmforgeError(f"zero stage must be 0, 1, 2 or 3, got {value}")
            given = overridden.get(key)
            if given in PARALLEL_STRATEGIES and get_strategy(given).zero_stage == value:
                continue  # train.parallel=fsdp with --zero-stage 3: the same stage, FSDP's engine
            value = f"zero{value}" if value else "none"
        if key in overridden:
            raise LmforgeError(f"{option(name)} and {key} say the same: give one of them")
        changes[key] = PRECISION_ALIASES.get(value, value) if name == "precision" else value
    return changes


def configure(base: Config, changes: dict) -> Config:
    """`base` with `changes` ({config key: value}) applied and validated, as `lmforge train` validates."""
    cfg, optimizer = copy.deepcopy(base), changes.get("optim.name")
    if optimizer is not None:  # the plan costs optimizers lmforge does not train (modes/)
        lookup(OPTIMIZERS, optimizer, "optimizer")
    for key, value in changes.items():
        if key != "optim.name" or OPTIMIZER_MODES[value].trained:
            set_value(cfg, key, value, origin="command line")
    validate(cfg)
    cfg.optim.name = optimizer or cfg.optim.name
    return cfg


class Planner:
    """The plans of `base` (the config of the preset or folder, --config and the overrides) under the
    options in args: plan(chosen) for one value of each LIST option; this machine measured once."""

    def __init__(self, base: Config, args, trace=None):
        self.base, self.args, self.machines = base, args, Machines(args.remeasure, trace)
        # the steps of a run are known: a run folder's (its config.yaml), or train.max_steps given
        self.own_steps = (args.run is not None and (Path(args.run) / "config.yaml").is_file()
                          or any(parse_override(item)[0] == "train.max_steps" for item in args.overrides))

    def plan(self, chosen: dict) -> dict:
        args = self.args
        try:
            if args.inference:
                return self._inference(chosen)
            changes = alias_changes(args, chosen)
            if changes.get("parallel.tp", self.base.parallel.tp) == 1:  # --sequence-parallel: with tp > 1 only
                changes.pop("parallel.sequence_parallel", None)
            cfg = configure(self.base, changes)
            costing = Costing(dp=chosen.get("dp"), hardware=chosen.get("hardware", "this"), mfu=args.mfu,
                              tokens=args.tokens, price_per_hour=args.price_per_hour,
                              reserve_bytes=args.reserve * 2**30, own_steps=self.own_steps)
            machine = None
            if costing.hardware == "this":
                name, peak, memory = self.machines.training(policy(cfg).matmul_dtype)
                machine = (f"this machine: {name}", peak, memory)
            plan = make_plan(cfg, costing, machine)
            # with `trace` (--roofline: the trainer's one-process engine) the step time by the roofline too
            predicted = self.machines.roofline(cfg, costing, plan) if self.machines.trace is not None else None
            if predicted is not None:
                plan["roofline"] = predicted
            return plan
        except ValueError as err:
            raise LmforgeError(str(err)) from None

    def _inference(self, chosen: dict) -> dict:
        args, model = self.args, self.base.model
        setup = InferenceSetup(batch_size=chosen.get("batch_size", 1), seq_len=chosen.get("seq_len", model.max_seq_len),
                               weights=chosen.get("weights", "bf16"), group_size=args.group_size or 128,
                               kv_dtype=chosen.get("kv_dtype", "bf16"), tp=chosen.get("tp", 1),
                               hardware=chosen.get("hardware", "this"), mfu=args.mfu,
                               reserve_bytes=args.reserve * 2**30)
        setup.validate(model)
        machine = self.machines.inference(setup.weights) if setup.hardware == "this" else None
        return make_inference_plan(model, setup, machine)

    def solve(self, chosen: dict) -> tuple[dict, str]:
        """--solve batch or devices, from the setup `chosen`: (its plan, the line that says what was found)."""
        if self.args.solve == "batch":
            if self.args.inference:  # linear in the batch: the plan says it directly
                largest = self.plan({**chosen, "batch_size": 1})["memory"]["largest_batch"]
            else:
                largest = largest_batch(lambda batch: self.plan({**chosen, "batch_size": batch})["memory"]["fits"])
            if largest == 0:
                return (self.plan({**chosen, "batch_size": 1}), "--solve batch: not even one sequence fits this setup "
                        "(the plan above is for batch 1)")
            return (self.plan({**chosen, "batch_size": largest}),
                    f"--solve batch: {largest} is the largest batch that fits (one more does not)")
        sharded = not self.args.inference and zero_stage(configure(self.base, alias_changes(self.args, chosen))) > 0
        candidates = device_candidates(self.base.model, sharded, self.args.inference)
        for tried in candidates:
            plan = self.plan({**chosen, **tried})
            if plan["memory"]["fits"]:
                shown = " x ".join(f"{k} {v}" for k, v in tried.items())
                return plan, f"--solve devices: {plan['setup']['devices']} device(s) ({shown}) is the fewest that fit"
        largest = " x ".join(f"{k} {max(c[k] for c in candidates)}" for k in candidates[0])
        raise LmforgeError(f"--solve devices: no setup up to {largest} fits; lower the batch or sequence, or "
                           "add recomputation or a higher --zero-stage")

