"""A plan: what a training setup will cost before it runs. FLOPs, memory per device, time.

`step_plan` is a step's cost per device, the core of a plan and what the trainer prints before its
first step (FLOPs, bytes per device, the peak behind MFU); `make_plan` adds what `lmforge plan` shows
besides (show.py prints it): the FLOPs by component and by the papers' formulas, the papers' memory
figures and an inference KV cache beside ours, the token budget's time and cost, what LoRA saves.

A Config says what each replica trains and how it is split (tensor, context and pipeline degrees,
the data-parallel strategy), not the world it runs on: how many data-parallel replicas, on what
hardware, at what assumed MFU, for how many tokens at what price. `Costing` holds those. The mesh's
degrees come from config/schema.py's mesh_degrees, the rule a launch checks itself with, so the
plan, the trainer and fine-tuning count the data-parallel degree one way. Everything here is
arithmetic on the two (the model's shapes read from it built on the meta device: accounting/shapes.py);
it imports no training code. The precision name is resolved once (`policy`) and the Policy handed
to the formulas; a pipeline's stages are counted in plan/pipeline.py.
"""

import dataclasses
from dataclasses import dataclass

from lmforge.accounting import comm, memory, shapes
from lmforge.accounting.activations import activation_breakdown, korthikanti_activation_bytes
from lmforge.accounting.cp import (context_parallel_section, local_tokens, ring_bytes_per_step, sequence_shards,
                                   shard_activations)
from lmforge.accounting.hardware import DEFAULT_RESERVE_BYTES, check_hardware, hardware_figures
from lmforge.accounting.lora import lora_parameters, lora_savings
from lmforge.common.errors import LmforgeError
from lmforge.config import Config
from lmforge.config.schema import Degrees, mesh_degrees
from lmforge.config.rules import check_composition
from lmforge.modes import Policy, get_policy, get_strategy

CHINCHILLA_TOKENS_PER_PARAMETER = 20


@dataclass
class Costing:
    """The world and the machine a plan is costed on: not settings of the run itself."""
    dp: int | None = None  # data-parallel degree; None: parallel.dp_replicate x parallel.dp_shard (unset: 1)
    hardware: str = "this"  # a name in hardware.ACCELERATORS, or "this" (its peak and memory measured)
    mfu: float = 0.5  # the model FLOPs utilisation assumed for time estimates
    tokens: float | None = None  # the token budget for total time and cost (None: Chinchilla's 20 per parameter)
    price_per_hour: float | None = None  # per device-hour, for the cost of the token budget
    # the plan of a run (lmforge train's; lmforge plan RUN or train.max_steps=N): the time of its own
    # train.max_steps too, shown before the budget's (a tiny run's minutes, not Chinchilla's hours)
    own_steps: bool = False
    reserve_bytes: float = DEFAULT_RESERVE_BYTES  # kept free per device: CUDA context, fragmentation

    def check(self) -> None:
        """LmforgeError naming the first value out of range (the command line's options check theirs as read)."""
        try:
            check_hardware(self.hardware)
        except ValueError as err:
            raise LmforgeError(str(err)) from None
        if not 0 < self.mfu <= 1:
            raise LmforgeError(f"mfu must be in (0, 1], got {self.mfu}")


def degrees(cfg: Config, dp: int | None = None) -> Degrees:
    """The mesh's five degrees with `dp` data-parallel replicas of cfg's pp x cp x tp (dp None: the
    config's own parallel.dp_replicate x parallel.dp_shard), by the launch's own rule."""
    p = cfg.parallel
    dp = dp or max(1, p.dp_replicate) * max(1, p.dp_shard)
    return mesh_degrees(cfg, dp * cfg.parallel.pp * p.cp * p.tp)


def data_parallel(cfg: Config, world: int) -> int:
    """The data-parallel degree of a launch of `world` ranks: world / (pp x cp x tp)."""
    return mesh_degrees(cfg, world).dp


def devices(d: Degrees) -> int:
    return d.pp * d.dp * d.cp * d.tp


def data_ranks(d: Degrees) -> int:
    """The ranks the gradients are reduced over and ZeRO/FSDP shard over: dp x cp (each cp rank
    one more replica of its shard: parallel/engine.py's dp x cp group)."""
    return d.dp * d.cp


def shard_ranks(d: Degrees) -> int:
    """The ranks ZeRO/FSDP shard the states over: the data ranks, or one dp_shard group of them
    under hybrid sharding (parallel/mesh.py)."""
    return data_ranks(d) // (d.dp_replicate if d.hybrid else 1)


def tokens_per_step(cfg: Config, d: Degrees) -> int:
    t = cfg.train
    return t.batch_size * cfg.seq_len * t.grad_accum * t.micro_batches * d.dp


def policy(cfg: Config) -> Policy:
    """The precision policy train.precision names (aliases resolved): what the formulas are given."""
    return get_policy(cfg.train.precision)


def matmul_dtype(precision: str) -> str:
    """The dtype whose peak FLOP/s a precision's matmuls are measured against (aliases allowed)."""
    return get_policy(precision).matmul_dtype


def zero_stage(cfg: Config) -> int:
    return get_strategy(cfg.train.parallel).zero_stage


def strategy(cfg: Config, d: Degrees) -> str:
    """train.parallel, or with "none" what the data ranks imply: ddp over several, none on one."""
    if cfg.train.parallel != "none":
        return cfg.train.parallel
    return "ddp" if data_ranks(d) > 1 else "none"


def lora(cfg: Config) -> tuple[int, str] | None:
    """(rank, targets) under LoRA, for the FLOP count; None for full training."""
    f = cfg.finetune
    return None if f.lora_rank is None else (f.lora_rank, f.lora_targets)


def setup_section(cfg: Config, costing: Costing, d: Degrees) -> dict:
    """plan["setup"]: what was planned, by the names the tables, charts and JSON readers use."""
    t, f = cfg.train, cfg.finetune
    return {"seq_len": cfg.seq_len, "precision": policy(cfg).name, "optimizer": cfg.optim.name,
            "zero_stage": zero_stage(cfg), "tp": d.tp, "pp": d.pp, "cp": d.cp,
            "sequence_parallel": cfg.parallel.sequence_parallel, "dp_replicate": d.dp_replicate if d.hybrid else 1,
            "virtual_stages": t.pipeline_virtual_stages, "attention": cfg.model.attention,
            "lora_rank": f.lora_rank, "lora_targets": f.lora_targets, **vars(costing), "dp": d.dp,
            **{key: getattr(t, key) for key in ("batch_size", "grad_accum", "parallel", "micro_batches", "schedule",
                                                "pipeline_split", "recompute", "fp32_attention", "loss_chunk_tokens",
                                                "bucket_mb")},
            "devices": devices(d), "tokens_per_step": tokens_per_step(cfg, d)}


@dataclass
class Cost:
    """What a setup's step costs per device, before the plan lays it out."""
    breakdown: dict  # the plan's memory parts (memory.breakdown_bytes)
    activations: dict  # saved for backward, by part (memory.activation_breakdown_bytes)
    communication: dict  # sent per step per rank (comm.py's terms)
    step_seconds: float
    pipeline: dict | None = None  # plan["pipeline"] when pp > 1
    largest_shapes: tuple | None = None  # the parameters of the largest stage (None: the whole model)


def step_plan(cfg: Config, costing: Costing, this_machine: tuple[str, float, float] | None = None,
              alone_too: bool = True) -> tuple[dict, Cost]:
    """What a step of `cfg` costs per device on `costing`'s world, as a JSON-ready dict (what the trainer
    prints and sets its measurements beside), and its Cost. `this_machine` = (name, peak FLOP/s,
    memory bytes) is needed when costing.hardware is "this" (the caller measures it; accounting stays
    pure). Without `alone_too`, a rank with no data-parallel peer counts no traffic (it sends nothing).
    LmforgeError for a setting the trainer would refuse."""
    costing.check()
    d = degrees(cfg, costing.dp)
    # config/rules.py's line for what a launch of the plan's devices would refuse (the launch check's and
    # the composition page's), on the step the plan costs: train.parallel as the plan reads it (strategy:
    # none over several data ranks is DDP's all-reduce) and no end-of-run sample
    train = dataclasses.replace(cfg.train, parallel=strategy(cfg, d), sample_tokens=0)
    check_composition(dataclasses.replace(cfg, train=train), world=devices(d))
    pol, m = policy(cfg), cfg.model
    hardware_name, peak, device_memory = hardware_figures(costing.hardware, pol.matmul_dtype, this_machine)[:3]
    per_token = shapes.training_flops_per_token(m, cfg.seq_len, lora=lora(cfg))
    step_flops = tokens_per_step(cfg, d) * per_token
    step_seconds = step_flops / (peak * costing.mfu * devices(d))
    if d.pp > 1:
        from lmforge.accounting.plan.pipeline import pipelined_cost  # which imports this module

        cost = pipelined_cost(cfg, d, pol, peak, costing.mfu)
    else:
        cost = _single_stage_cost(cfg, d, pol, step_seconds, alone_too)
    total = sum(cost.breakdown.values())
    plan = {
        "model": {"family": m.family, "parameters": memory.parameter_count(m), "layers": m.n_layers,
                  "d_model": m.d_model, "heads": m.n_heads, "kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim,
                  "vocab_size": m.vocab_size},
        "setup": setup_section(cfg, costing, d),
        "flops": {"training_per_token": per_token,
                  "hardware_per_token": shapes.hardware_flops_per_token(m, cfg.seq_len, cfg.train.recompute,
                                                                       lora=lora(cfg)),
                  "training_per_step": step_flops},
        "memory": {"per_device_bytes": total, "breakdown_bytes": cost.breakdown,
                   "activation_breakdown_bytes": cost.activations, "device_memory_bytes": device_memory,
                   "reserve_bytes": costing.reserve_bytes, "fits": total + costing.reserve_bytes <= device_memory},
        "communication": cost.communication,
        "time": {"hardware": hardware_name, "peak_flops_per_device": peak, "matmul_dtype": pol.matmul_dtype,
                 "assumed_mfu": costing.mfu, "seconds_per_step": cost.step_seconds,
                 "tokens_per_second": tokens_per_step(cfg, d) / cost.step_seconds},
    }
    if cost.pipeline is not None:
        plan["pipeline"] = cost.pipeline
    if d.cp > 1:
        plan["context_parallel"] = context_parallel_section(cfg, d, step_flops / devices(d), per_token)
    return plan, cost


def _single_stage_cost(cfg: Config, d: Degrees, pol: Policy, step_seconds: float, alone_too: bool) -> Cost:
    """The whole model on each device (split tp ways, sharded by ZeRO over dp); `alone_too`: step_plan's."""
    m, t, sp = cfg.model, cfg.train, cfg.parallel.sequence_parallel
    b, s, how = t.batch_size, cfg.seq_len, strategy(cfg, d)
    held_lora = None if lora(cfg) is None else lora_parameters(m, *lora(cfg), d.tp)
    states = memory.model_state_bytes(m, pol, cfg.optim.name, zero_stage(cfg), shard_ranks(d), d.tp,
                                      lora_trainable=held_lora, fully_shard=how == "fsdp")
    # the sharding engines compute on 16-bit working weights under a mixed policy: no weight casts
    layout = memory.sharded_layout(pol, get_strategy(how).zero_stage)
    if d.cp > 1:  # this rank's zig-zag shard of every row (accounting/cp.py)
        activations, logits = shard_activations(cfg, d, layout)
    else:
        activations = activation_breakdown(m, b, s, layout, m.attention, t.recompute, d.tp, t.fp32_attention,
                                                  t.loss_chunk_tokens, sp)
        logits = memory.logits_bytes(m, b, s, pol, t.loss_chunk_tokens) / d.tp
    breakdown = {**states,
                 "weight_copies": activations.pop("weight_copies"),
                 "activations": sum(activations.values()),
                 "logits": logits}
    # with cp, each cp rank is one more replica to the gradient all-reduce (parallel/engine.py's dp x cp group)
    if alone_too or data_ranks(d) > 1:
        communication = comm.step_communication(m, how, shard_ranks(d), pol, t.grad_accum, lora=lora(cfg), tp=d.tp,
                                                optimizer=cfg.optim.name, replicate=d.dp_replicate if d.hybrid else 1)
    else:
        communication = {"strategy": how, "sent_bytes": 0}
    if d.tp > 1:  # the tensor ranks' activations (of this rank's tokens), besides the replicas' gradients
        tokens = local_tokens(s, d.cp, sequence_shards(cfg)) if d.cp > 1 else s
        communication["tensor_parallel"] = comm.tensor_parallel_communication(
            m, b, tokens, d.tp, sp, layout, t.grad_accum, cfg.optim.name, recompute=t.recompute, lora=lora(cfg))
    if d.cp > 1:  # the ring's K/V and dK/dV (accounting/cp.py)
        communication["context_parallel"] = ring_bytes_per_step(cfg, d, layout)
    return Cost(breakdown, activations, communication, step_seconds)


def make_plan(cfg: Config, costing: Costing | None = None,
              this_machine: tuple[str, float, float] | None = None) -> dict:
    """The plan of `cfg` on `costing`'s world as a JSON-ready dict: step_plan's (`this_machine`
    and the errors as there) with `lmforge plan`'s figures added. The step time from the roofline is
    opt-in, added by its callers (accounting/roofline/ops.py's predict_step)."""
    costing = costing or Costing()
    plan, cost = step_plan(cfg, costing, this_machine)
    d, n_params, m, s = degrees(cfg, costing.dp), plan["model"]["parameters"], cfg.model, cfg.seq_len
    plan["model"]["matmul_parameters"] = shapes.model_shapes(m).matmul_weights
    plan["flops"].update({
        "forward_per_token_by_component": shapes.forward_flops_breakdown(m, s),
        "training_per_token_causal_halved": shapes.training_flops_per_token(m, s, causal=True, lora=lora(cfg)),
        "six_n_per_token": shapes.six_n_flops_per_token(m),
        "palm_per_token": shapes.palm_flops_per_token(m, s),
    })
    plan["memory"].update(_papers_memory(cfg, d, policy(cfg), n_params))
    plan["budget"] = _budget(cfg, plan, costing, n_params)
    if cfg.finetune.lora_rank is not None:  # against training every weight (a pipeline: of the largest stage)
        full = memory.model_state_bytes(m, policy(cfg), cfg.optim.name, zero_stage(cfg), shard_ranks(d), d.tp,
                                        parameter_shapes=cost.largest_shapes, fully_shard=strategy(cfg, d) == "fsdp")
        plan["lora"] = lora_savings(m, *lora(cfg), full, cost.breakdown, n_params)
    return plan


def _papers_memory(cfg: Config, d: Degrees, pol: Policy, n_params: int) -> dict:
    """The papers' figures beside plan["memory"]'s parts, and an inference KV cache at this batch x seq."""
    m, b, s, recompute = cfg.model, cfg.train.batch_size, cfg.seq_len, cfg.train.recompute
    # The paper's reference figure (standard attention, 16-bit), and its FlashAttention variant.
    korthikanti, korthikanti_flash = (
        korthikanti_activation_bytes(s, b, m.d_model, m.n_heads, m.n_layers, recompute, d.tp,
                                     cfg.parallel.sequence_parallel, flash=flash) for flash in (False, True))
    return {
        "kv_cache_inference_bytes": memory.kv_cache_bytes(m, b, s, pol.bytes.compute),
        "zero_paper_model_state_bytes": memory.zero_paper_model_state_bytes(n_params, zero_stage(cfg), shard_ranks(d)),
        "activations_korthikanti_bytes": korthikanti,
        "activations_korthikanti_flash_bytes": korthikanti_flash,
        "parameters_16bit_bytes": 2 * n_params,
        "activations_to_16bit_parameters_ratio": korthikanti / (2 * n_params),
    }


def _budget(cfg: Config, plan: dict, costing: Costing, n_params: int) -> dict:
    """plan["budget"], and the token budget's time in plan["time"]: the steps it takes at the assumed MFU."""
    # Without a budget, the compute-optimal one: about 20 training tokens per parameter (Hoffmann
    # et al. 2022, "Training Compute-Optimal Large Language Models", table 3).
    budget, price = costing.tokens or CHINCHILLA_TOKENS_PER_PARAMETER * n_params, costing.price_per_hour
    setup, time = plan["setup"], plan["time"]
    seconds_for_budget = budget / setup["tokens_per_step"] * time["seconds_per_step"]
    device_hours = seconds_for_budget * setup["devices"] / 3600
    time.update(tokens=budget, seconds_for_tokens=seconds_for_budget,
                tokens_source="given" if costing.tokens else f"Chinchilla: {CHINCHILLA_TOKENS_PER_PARAMETER} "
                                                             "tokens per parameter (Hoffmann et al. 2022)")
    if costing.own_steps:
        steps = cfg.train.max_steps
        time["run"] = {"steps": steps, "tokens": steps * setup["tokens_per_step"],
                       "seconds": steps * time["seconds_per_step"]}
    return {
        "training_flops": budget * plan["flops"]["training_per_token"],
        "device_hours": device_hours,
        "price_per_device_hour": price,
        "cost": device_hours * price if price is not None else None,
    }
