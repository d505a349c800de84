"""A context-parallel setup's plan (parallel.cp = cp > 1): each of the cp ranks of a replica holds
n = padded / cp tokens of every row (two zig-zag chunks of padded / 2cp; parallel/cp.py), so what
it saves for backward is its shard's (accounting/cp.py's ring_activation_breakdown), its logits
are its tokens', and it sends the ring's K/V and dK/dV (accounting/cp.py's context_parallel_bytes)
besides the data-parallel engine's gradient traffic over the dp x cp ranks (parallel/engine.py).
Every cp rank is one more replica to that engine, so the model states are those of the strategy over
dp x cp ranks (costing.data_ranks): DDP's whole on every rank, ZeRO's and FSDP's sharded 1/(dp cp)
(split tp ways first under tp x cp).
"""

from lmforge.accounting import flops, memory
from lmforge.accounting.cp import context_parallel_bytes, padded_length, ring_activation_breakdown
from lmforge.accounting.plan.costing import devices, lora
from lmforge.config import Config
from lmforge.config.schema import Degrees
from lmforge.modes import Policy


def sequence_shards(cfg: Config) -> int:
    """tp under sequence parallelism (each cp shard cut again over the tp ranks: parallel/cp_model.py), else 1."""
    tp = cfg.parallel.tp
    return tp if tp > 1 and cfg.parallel.sequence_parallel else 1


def local_tokens(seq_len: int, cp: int, sequence_shards: int = 1) -> int:
    """Tokens of each row one of cp ranks holds: the length padded to a multiple of 2 cp (and of cp
    tp under sequence parallelism over `sequence_shards` = tp ranks), over cp."""
    return padded_length(seq_len, cp, sequence_shards) // cp


def ring_bytes_per_step(cfg: Config, d: Degrees, layout: Policy) -> dict:
    """What one rank sends around the ring in an optimizer step: grad_accum micro-batches of K/V in
    the attention core's dtype (fp32 under train.fp32_attention) and of the fp32 dK/dV accumulators."""
    t = cfg.train
    element = 4 if t.fp32_attention else layout.bytes.compute
    micro = context_parallel_bytes(cfg.model, t.batch_size, cfg.seq_len, d.cp, element, t.recompute, d.tp,
                                   sequence_shards(cfg) > 1)
    step = {key: t.grad_accum * value for key, value in micro.items()}
    return {**step, "sent_bytes": step["forward"] + step["backward"]}


def shard_activations(cfg: Config, d: Degrees, layout: Policy) -> tuple[dict, float]:
    """(saved for backward by part, logits bytes) of one rank's shard of a micro-batch."""
    t, shards = cfg.train, sequence_shards(cfg)
    b, n = t.batch_size, local_tokens(cfg.seq_len, d.cp, shards)
    saved = ring_activation_breakdown(cfg.model, b, cfg.seq_len, d.cp, layout, t.recompute, d.tp, t.fp32_attention,
                                      shards > 1)
    return saved, memory.logits_bytes(cfg.model, b, n, layout) / d.tp


def context_parallel_section(cfg: Config, d: Degrees, step_flops: float) -> dict:
    """plan["context_parallel"]: the split, the tokens and model FLOPs of each rank (the zig-zag gives
    every rank the same causal work: docs/context-parallel.md), and the mesh."""
    shards, s, cp = sequence_shards(cfg), cfg.seq_len, d.cp
    padded, n = padded_length(s, cp, shards), local_tokens(s, cp, shards)
    return {
        "cp": cp, "mesh": f"dp {d.dp} x cp {cp} x tp {d.tp}",
        "padded_seq_len": padded, "chunks": 2 * cp, "chunk_tokens": padded // (2 * cp),
        "tokens_per_rank_per_sequence": n,
        "tokens_per_rank_per_step": cfg.train.batch_size * n * cfg.train.grad_accum,
        "training_flops_per_rank_per_step": step_flops / devices(d),
        "training_flops_per_token": flops.training_flops_per_token(cfg.model, s, lora=lora(cfg)),
    }
