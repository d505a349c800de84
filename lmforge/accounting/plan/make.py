"""A plan: what a training setup will cost before it runs. FLOPs, memory per device, time.

Everything here is arithmetic on a Config (its model's shapes read from it built on the meta
device: shapes.py) and a Costing (costing.py: the world and the machine, which a Config does not
hold); it imports no training code. `lmforge plan` prints it (show.py), and the trainer prints the
same plan before it starts and sets its measurements beside it at the end. The precision name is
resolved once (costing.policy) and the Policy handed to the formulas; a pipeline's stages are
counted in pipeline.py.
"""

import dataclasses
from dataclasses import dataclass

from lmforge.accounting import comm, flops, memory
from lmforge.accounting.activations import activation_breakdown, korthikanti_activation_bytes
from lmforge.accounting.hardware import ACCELERATORS, accelerator_peak
from lmforge.accounting.pipeline import rank_chunks, stage_communication
from lmforge.accounting.plan.context_parallel import (context_parallel_section, local_tokens, ring_bytes_per_step,
                                                      sequence_shards, shard_activations)
from lmforge.accounting.plan.costing import (Costing, degrees, devices, lora, policy, setup_section,
                                             shard_ranks, strategy, tokens_per_step, zero_stage)
from lmforge.accounting.plan.pipeline import pipeline_plan, rank_parameters, stage_tensor_parallel
from lmforge.accounting.shapes import model_shapes
from lmforge.config import Config
from lmforge.config.rules import check_composition
from lmforge.config.degrees import Degrees
from lmforge.modes.parallel import get_strategy
from lmforge.modes.precision import Policy, get_policy


CHINCHILLA_TOKENS_PER_PARAMETER = 20


def matmul_dtype(precision: str) -> str:
    """The dtype whose peak FLOP/s a precision's matmuls are measured against (aliases allowed)."""
    return get_policy(precision).matmul_dtype


@dataclass
class Cost:
    """What a setup's step costs per device, before the plan lays it out."""
    breakdown: dict  # the plan's memory parts (memory.breakdown_bytes)
    activations: dict  # saved for backward, by part (memory.activation_breakdown_bytes)
    communication: dict  # sent per step per rank (comm.py's terms)
    step_seconds: float
    pipeline: dict | None = None  # plan["pipeline"] when pp > 1
    largest_shapes: tuple | None = None  # the parameters of the largest stage (None: the whole model)


def make_plan(cfg: Config, costing: Costing | None = None,
              this_machine: tuple[str, float, float] | None = None) -> dict:
    """The plan of `cfg` on `costing`'s world as a JSON-ready dict. `this_machine` = (name, peak FLOP/s,
    memory bytes) is needed when costing.hardware is "this" (the caller measures it; accounting stays
    pure). The step time from the roofline is opt-in, added by its callers (accounting/roofline/ops.py's
    predict_step). LmforgeError for a setting the trainer would refuse."""
    costing = costing or Costing()
    costing.check()
    d = degrees(cfg, costing.dp)
    _check_composition(cfg, d)
    pol, m = policy(cfg), cfg.model
    hardware_name, peak, device_memory = _hardware(costing, pol, this_machine)
    n_params = memory.parameter_count(m)
    adapters = None if cfg.finetune.lora_rank is None else memory.lora_parameters(m, *lora(cfg))
    step_flops = tokens_per_step(cfg, d) * flops.training_flops_per_token(m, cfg.seq_len, lora=lora(cfg))
    if d.pp > 1:
        cost = _pipelined_cost(cfg, d, pol, peak, costing.mfu)
    else:
        cost = _single_stage_cost(cfg, d, pol, adapters, step_flops / (peak * costing.mfu * devices(d)))
    plan = {
        "model": {"family": m.family, "parameters": n_params, "matmul_parameters": model_shapes(m).matmul_weights,
                  "layers": m.n_layers, "d_model": m.d_model, "heads": m.n_heads, "kv_heads": m.kv_heads,
                  "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size},
        "setup": setup_section(cfg, costing, d),
        "flops": _flops(cfg, step_flops),
        "memory": _memory(cfg, d, pol, cost, device_memory, costing.reserve_bytes, n_params),
        "communication": cost.communication,
        **_time_and_budget(cfg, d, costing, pol, hardware_name, peak, cost.step_seconds, n_params),
    }
    if adapters is not None:
        plan["lora"] = _lora(cfg, d, pol, cost, adapters, n_params)
    if cost.pipeline is not None:
        plan["pipeline"] = cost.pipeline
    if d.cp > 1:
        plan["context_parallel"] = context_parallel_section(cfg, d, step_flops)
    return plan


def _check_composition(cfg: Config, d: Degrees) -> None:
    """config/rules.py's line for what a launch of the plan's devices would refuse (the launch check's
    and the composition page's), on the step the plan costs: train.parallel as the plan reads it
    (costing.strategy: none over several data ranks is DDP's all-reduce) and no end-of-run sample."""
    train = dataclasses.replace(cfg.train, parallel=strategy(cfg, d), sample_tokens=0)
    check_composition(dataclasses.replace(cfg, train=train), world=devices(d))


def _hardware(costing: Costing, pol: Policy, this_machine: tuple | None) -> tuple[str, float, float]:
    """(name, peak FLOP/s at the policy's matmul dtype, memory bytes) of costing.hardware."""
    if costing.hardware == "this":
        if this_machine is None:
            raise ValueError("hardware 'this' needs the measured (name, peak FLOP/s, memory bytes)")
        return this_machine
    return (costing.hardware, accelerator_peak(costing.hardware, pol.matmul_dtype),
            ACCELERATORS[costing.hardware].memory_bytes)


def _pipelined_cost(cfg: Config, d: Degrees, pol: Policy, peak: float, mfu: float) -> Cost:
    """Every stage counted on its own (plan/pipeline.py); a device holds the largest."""
    piped = pipeline_plan(cfg, d, pol, peak * mfu, mfu)
    largest = piped["stages_detail"][piped["largest_stage"]]
    first, held = (rank_parameters(cfg, d, piped["split"], s) for s in (0, piped["largest_stage"]))
    layout = memory.sharded_layout(pol, zero_stage(cfg))
    # rank 0's, as the trainer counts
    communication = stage_communication(first, d.dp, layout, zero_stage(cfg), cfg.optim.name)
    if d.tp > 1:
        layers = sum(map(len, rank_chunks(piped["split"], d.pp, 0)))
        communication["tensor_parallel"] = stage_tensor_parallel(cfg, d, layout, 0, layers)
    return Cost(largest["breakdown_bytes"], largest["activation_breakdown_bytes"], communication,
                piped["seconds_per_step"], piped, held.shapes)


def _single_stage_cost(cfg: Config, d: Degrees, pol: Policy, adapters: int | None, step_seconds: float) -> Cost:
    """The whole model on each device (split tp ways, sharded by ZeRO over dp)."""
    m, t, sp = cfg.model, cfg.train, cfg.parallel.sequence_parallel
    b, s, how = t.batch_size, cfg.seq_len, strategy(cfg, d)
    held_lora = None if adapters is None else memory.lora_parameters(m, *lora(cfg), d.tp)
    states = memory.model_state_bytes(m, pol, cfg.optim.name, zero_stage(cfg), shard_ranks(d), d.tp,
                                      lora_trainable=held_lora, fully_shard=how == "fsdp")
    # the sharding engines compute on 16-bit working weights under a mixed policy: no weight casts
    layout = memory.sharded_layout(pol, get_strategy(how).zero_stage)
    if d.cp > 1:  # this rank's zig-zag shard of every row (plan/context_parallel.py)
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
    communication = comm.step_communication(m, how, shard_ranks(d), pol, t.grad_accum, lora=lora(cfg), tp=d.tp,
                                            optimizer=cfg.optim.name, replicate=d.dp_replicate if d.hybrid else 1)
    if d.tp > 1:  # the tensor ranks' activations (of this rank's tokens), besides the replicas' gradients
        tokens = local_tokens(s, d.cp, sequence_shards(cfg)) if d.cp > 1 else s
        communication["tensor_parallel"] = comm.tensor_parallel_communication(
            m, b, tokens, d.tp, sp, layout, t.grad_accum, cfg.optim.name, recompute=t.recompute, lora=lora(cfg))
    if d.cp > 1:  # the ring's K/V and dK/dV (accounting/cp.py)
        communication["context_parallel"] = ring_bytes_per_step(cfg, d, layout)
    return Cost(breakdown, activations, communication, step_seconds)


def _flops(cfg: Config, step_flops: float) -> dict:
    m, s, t = cfg.model, cfg.seq_len, cfg.train
    return {
        "forward_per_token_by_component": flops.forward_flops_breakdown(m, s),
        "training_per_token": flops.training_flops_per_token(m, s, lora=lora(cfg)),
        "training_per_token_causal_halved": flops.training_flops_per_token(m, s, causal=True, lora=lora(cfg)),
        "hardware_per_token": flops.hardware_flops_per_token(m, s, t.recompute, lora=lora(cfg)),
        "six_n_per_token": flops.six_n_flops_per_token(m),
        "palm_per_token": flops.palm_flops_per_token(m, s),
        "training_per_step": step_flops,
    }


def _memory(cfg: Config, d: Degrees, pol: Policy, cost: Cost, device_memory: float, reserve: float,
            n_params: int) -> dict:
    """plan["memory"]: the cost's parts per device, whether they fit, and the papers' figures beside them."""
    m, b, s, recompute = cfg.model, cfg.train.batch_size, cfg.seq_len, cfg.train.recompute
    total = sum(cost.breakdown.values())
    # The paper's reference figure (standard attention, 16-bit), and its FlashAttention variant.
    korthikanti, korthikanti_flash = (
        korthikanti_activation_bytes(s, b, m.d_model, m.n_heads, m.n_layers, recompute, d.tp,
                                            cfg.parallel.sequence_parallel, flash=flash) for flash in (False, True))
    return {
        "per_device_bytes": total,
        "breakdown_bytes": cost.breakdown,
        "activation_breakdown_bytes": cost.activations,
        "device_memory_bytes": device_memory,
        "reserve_bytes": reserve,
        "fits": total + reserve <= device_memory,
        "kv_cache_inference_bytes": memory.kv_cache_bytes(m, b, s, pol.bytes.compute),
        "zero_paper_model_state_bytes": memory.zero_paper_model_state_bytes(n_params, zero_stage(cfg),
                                                                            shard_ranks(d)),
        "activations_korthikanti_bytes": korthikanti,
        "activations_korthikanti_flash_bytes": korthikanti_flash,
        "parameters_16bit_bytes": 2 * n_params,
        "activations_to_16bit_parameters_ratio": korthikanti / (2 * n_params),
    }


def _time_and_budget(cfg: Config, d: Degrees, costing: Costing, pol: Policy, hardware_name: str, peak: float,
                     step_seconds: float, n_params: int) -> dict:
    """plan["time"] and plan["budget"]: a step at the assumed MFU, and the token budget's time and cost."""
    # Without a budget, the compute-optimal one: about 20 training tokens per parameter (Hoffmann
    # et al. 2022, "Training Compute-Optimal Large Language Models", table 3).
    budget, price = costing.tokens or CHINCHILLA_TOKENS_PER_PARAMETER * n_params, costing.price_per_hour
    seconds_for_budget = budget / tokens_per_step(cfg, d) * step_seconds
    device_hours = seconds_for_budget * devices(d) / 3600
    time = {
        "hardware": hardware_name,
        "peak_flops_per_device": peak,
        "matmul_dtype": pol.matmul_dtype,
        "assumed_mfu": costing.mfu,
        "seconds_per_step": step_seconds,
        "tokens_per_second": tokens_per_step(cfg, d) / step_seconds,
        "tokens": budget,
        "tokens_source": "given" if costing.tokens else f"Chinchilla: {CHINCHILLA_TOKENS_PER_PARAMETER} tokens "
                                                        "per parameter (Hoffmann et al. 2022)",
        "seconds_for_tokens": seconds_for_budget,
    }
    return {"time": time, "budget": {
        "training_flops": budget * flops.training_flops_per_token(cfg.model, cfg.seq_len, lora=lora(cfg)),
        "device_hours": device_hours,
        "price_per_device_hour": price,
        "cost": device_hours * price if price is not None else None,
    }}


def _lora(cfg: Config, d: Degrees, pol: Policy, cost: Cost, adapters: int, n_params: int) -> dict:
    """plan["lora"]: what LoRA saves against training every weight: gradients, master copies and
    moments of the frozen base. Activations stay in the plan as for full fine-tuning: the gradient
    of an early adapter flows back through every later layer, which therefore keeps its inputs."""
    full = memory.model_state_bytes(cfg.model, pol, cfg.optim.name, zero_stage(cfg), shard_ranks(d), d.tp,
                                    parameter_shapes=cost.largest_shapes, fully_shard=strategy(cfg, d) == "fsdp")
    rank, targets = lora(cfg)
    return {"rank": rank, "targets": targets, "trainable_parameters": adapters,
            "trainable_fraction": adapters / n_params,
            "full_finetune_state_bytes": full,
            "saved_bytes": {key: full[key] - cost.breakdown[key] for key in full}}
