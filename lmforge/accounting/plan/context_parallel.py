"""A context-parallel setup's plan (parallel.cp = cp > 1): each of the cp ranks of a replica holds
n = padded / cp tokens of every row (two zig-zag chunks of padded / 2cp; parallel/cp.py), so what
it saves for backward is its shard's (accounting/cp.py's ring_activation_breakdown), its logits
are its tokens', and it sends the ring's K/V and dK/dV (accounting/cp.py's context_parallel_bytes)
besides the data-parallel engine's gradient traffic over the dp x cp ranks (parallel/cp_engine.py).
Every cp rank is one more replica to that engine, so the model states are those of the strategy over
dp x cp ranks (Setup.data_ranks): DDP's whole on every rank, ZeRO's and FSDP's sharded 1/(dp cp)
(split tp ways first under tp x cp).
"""

from lmforge.accounting import flops, memory
from lmforge.accounting.cp import context_parallel_bytes, padded_length, ring_activation_breakdown
from lmforge.config import ModelConfig
from lmforge.modes.precision import Policy


def check_context_parallel(setup, model: ModelConfig | None) -> None:
    """ValueError for what the trainer refuses with cp > 1 (parallel/launch.py's CP_REFUSED), in its terms."""
    refused = [(setup.pp > 1, "a pipeline (--pp)"),
               (setup.loss_chunk_tokens > 0, "the chunked loss"),
               (setup.seq_len < 2 * setup.cp, f"a sequence shorter than 2 x cp = {2 * setup.cp} tokens")]
    if model is not None:
        refused += [(model.sliding_window is not None, "a sliding window"), (model.dropout > 0, "dropout")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"cp {setup.cp} does not combine with {what} (docs/context-parallel.md)")


def sequence_shards(setup) -> int:
    """tp under sequence parallelism (each cp shard cut again over the tp ranks: parallel/cp_model.py), else 1."""
    return setup.tp if setup.tp > 1 and setup.sequence_parallel else 1


def local_tokens(seq_len: int, cp: int, sequence_shards: int = 1) -> int:
    """Tokens of each row one of cp ranks holds: the length padded to a multiple of 2 cp (and of cp
    tp under sequence parallelism over `sequence_shards` = tp ranks), over cp."""
    return padded_length(seq_len, cp, sequence_shards) // cp


def ring_bytes_per_step(cfg: ModelConfig, setup, layout: Policy) -> dict:
    """What one rank sends around the ring in an optimizer step: grad_accum micro-batches of K/V in
    the attention core's dtype (fp32 under train.fp32_attention) and of the fp32 dK/dV accumulators."""
    element = 4 if setup.fp32_attention else layout.bytes.compute
    micro = context_parallel_bytes(cfg, setup.batch_size, setup.seq_len, setup.cp, element, setup.recompute, setup.tp,
                                   sequence_shards(setup) > 1)
    step = {key: setup.grad_accum * value for key, value in micro.items()}
    return {**step, "sent_bytes": step["forward"] + step["backward"]}


def shard_activations(cfg: ModelConfig, setup, layout: Policy) -> tuple[dict, float]:
    """(saved for backward by part, logits bytes) of one rank's shard of a micro-batch."""
    b, n = setup.batch_size, local_tokens(setup.seq_len, setup.cp, sequence_shards(setup))
    saved = ring_activation_breakdown(cfg, b, setup.seq_len, setup.cp, layout, setup.recompute, setup.tp,
                                      setup.fp32_attention, sequence_shards(setup) > 1)
    return saved, memory.logits_bytes(cfg, b, n, layout) / setup.tp


def context_parallel_section(cfg: ModelConfig, setup, step_flops: float) -> dict:
    """plan["context_parallel"]: the split, the tokens and model FLOPs of each rank (the zig-zag gives
    every rank the same causal work: docs/context-parallel.md), and the mesh."""
    shards = sequence_shards(setup)
    padded, n = padded_length(setup.seq_len, setup.cp, shards), local_tokens(setup.seq_len, setup.cp, shards)
    return {
        "cp": setup.cp, "mesh": f"dp {setup.dp} x cp {setup.cp} x tp {setup.tp}",
        "padded_seq_len": padded, "chunks": 2 * setup.cp, "chunk_tokens": padded // (2 * setup.cp),
        "tokens_per_rank_per_sequence": n,
        "tokens_per_rank_per_step": setup.batch_size * n * setup.grad_accum,
        "training_flops_per_rank_per_step": step_flops / setup.devices,
        "training_flops_per_token": flops.training_flops_per_token(cfg, setup.seq_len, lora=setup.lora),
    }
