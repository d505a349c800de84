"""What a plan needs besides its Config, and the numbers derived from the two, in one place.

A Config says what each replica trains and how it is split (tensor, context and pipeline degrees,
the data-parallel strategy); it does not hold the world it runs on: how many data-parallel
replicas, on what hardware, at what assumed MFU, for how many tokens at what price. `Costing`
holds those. The mesh's degrees come from config/degrees.py's mesh_degrees, the rule a launch
checks itself with, so the plan, the trainer and fine-tuning count the data-parallel degree one way.
"""

from dataclasses import dataclass

from lmforge.accounting.hardware import DEFAULT_RESERVE_BYTES, check_hardware
from lmforge.common.errors import LmforgeError
from lmforge.config import Config
from lmforge.config.degrees import Degrees, mesh_degrees
from lmforge.modes.parallel import get_strategy
from lmforge.modes.precision import Policy, get_policy


@dataclass
class Costing:
    """The world and the machine a plan is costed on: not settings of the run itself."""
    dp: int | None = None  # data-parallel degree; None: parallel.dp_replicate x parallel.dp_shard (unset: 1)
    hardware: str = "this"  # a name in hardware.ACCELERATORS, or "this" (its peak and memory measured)
    mfu: float = 0.5  # the model FLOPs utilisation assumed for time estimates
    tokens: float | None = None  # the token budget for total time and cost (None: Chinchilla's 20 per parameter)
    price_per_hour: float | None = None  # per device-hour, for the cost of the token budget
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
