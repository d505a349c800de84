"""A plan: what a training setup will cost before it runs. FLOPs, memory per device, time.

The step's cost per device is plan/costing.py's `step_plan` (what the trainer prints before its first
step); `make_plan` adds what `lmforge plan` shows besides (show.py prints it): the FLOPs by component
and by the papers' formulas, the papers' memory figures and an inference KV cache beside ours, the
token budget's time and cost, and what LoRA saves. Arithmetic on a Config and a Costing; it imports
no training code.
"""

from lmforge.accounting import flops, memory
from lmforge.accounting.activations import korthikanti_activation_bytes
from lmforge.accounting.plan.costing import (Cost, Costing, degrees, lora, matmul_dtype, policy, shard_ranks,
                                             step_plan, strategy, zero_stage)
from lmforge.accounting.shapes import model_shapes
from lmforge.config import Config
from lmforge.config.schema import Degrees
from lmforge.modes import Policy

__all__ = ["Costing", "make_plan", "matmul_dtype"]

CHINCHILLA_TOKENS_PER_PARAMETER = 20


def make_plan(cfg: Config, costing: Costing | None = None,
              this_machine: tuple[str, float, float] | None = None) -> dict:
    """The plan of `cfg` on `costing`'s world as a JSON-ready dict: costing.step_plan's (`this_machine`
    and the errors as there) with `lmforge plan`'s figures added. The step time from the roofline is
    opt-in, added by its callers (accounting/roofline/ops.py's predict_step)."""
    costing = costing or Costing()
    plan, cost = step_plan(cfg, costing, this_machine)
    d, n_params, m, s = degrees(cfg, costing.dp), plan["model"]["parameters"], cfg.model, cfg.seq_len
    plan["model"]["matmul_parameters"] = model_shapes(m).matmul_weights
    plan["flops"].update({
        "forward_per_token_by_component": flops.forward_flops_breakdown(m, s),
        "training_per_token_causal_halved": flops.training_flops_per_token(m, s, causal=True, lora=lora(cfg)),
        "six_n_per_token": flops.six_n_flops_per_token(m),
        "palm_per_token": flops.palm_flops_per_token(m, s),
    })
    plan["memory"].update(_papers_memory(cfg, d, policy(cfg), n_params))
    plan["budget"] = _budget(cfg, plan, costing, n_params)
    if cfg.finetune.lora_rank is not None:
        plan["lora"] = _lora(cfg, d, plan, cost, n_params)
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


def _lora(cfg: Config, d: Degrees, plan: dict, cost: Cost, n_params: int) -> dict:
    """plan["lora"]: what LoRA saves against training every weight: gradients, master copies and
    moments of the frozen base. Activations stay in the plan as for full fine-tuning: the gradient
    of an early adapter flows back through every later layer, which therefore keeps its inputs."""
    full = memory.model_state_bytes(cfg.model, policy(cfg), cfg.optim.name, zero_stage(cfg), shard_ranks(d), d.tp,
                                    parameter_shapes=cost.largest_shapes, fully_shard=strategy(cfg, d) == "fsdp")
    rank, targets = lora(cfg)
    adapters = memory.lora_parameters(cfg.model, rank, targets)
    return {"rank": rank, "targets": targets, "trainable_parameters": adapters,
            "trainable_fraction": adapters / n_params,
            "full_finetune_state_bytes": full,
            "saved_bytes": {key: full[key] - cost.breakdown[key] for key in full}}
