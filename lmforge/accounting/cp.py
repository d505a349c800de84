"""Bytes each rank sends around the context-parallel ring (parallel/cp.py), per attention layer and
per step: pure arithmetic from the shapes, checked against the bytes the ring really sends.

With cp ranks, a sequence padded to a multiple of 2 cp and n = padded / cp tokens per rank, one
K/V message is K and V of the local shard: M = 2 b kv_heads n d_head elements. Per layer per rank:

    forward    (cp - 1) messages of M in the activations' dtype (each rank's K/V visits the others)
    backward   (cp - 1) of M again (K/V go round once more: nothing of other ranks is kept)
             + cp of M in fp32: the dK/dV accumulator travels with its K/V and hops home at the end

cp = 1 sends nothing. Grouped-query attention shrinks M by heads / kv_heads: the ring carries
KV heads, not query heads. Recomputation (wrap.py, selective or full) reruns attention's
forward in backward, and with it the ring's forward: `recompute` counts those messages twice (the
backward's own are unchanged: the rerun forward keeps no state the backward ring would skip).
The loss count and the
gradient all-reduce across the CP group are collectives of parallel/comm.py, counted there.

What a rank saves for backward (`ring_activation_breakdown`): every layer at its n tokens, as one
process saves for a sequence of n (memory.activation_breakdown), but for what the ring does
differently from a fused kernel; tests/test_cp_accounting_dist.py measures it to the byte.

The plan of a context-parallel setup (parallel.cp = cp > 1; the second half of this module): each
of the cp ranks of a replica holds n = padded / cp tokens of every row (two zig-zag chunks of
padded / 2cp; parallel/cp.py), so what it saves for backward is its shard's
(ring_activation_breakdown), its logits are its tokens', and it sends the ring's K/V and dK/dV
(context_parallel_bytes) besides the data-parallel engine's gradient traffic over the dp x cp
ranks (parallel/engine.py). Every cp rank is one more replica to that engine, so the model states
are those of the strategy over dp x cp ranks (plan/make.py's data_ranks): DDP's whole on every
rank, ZeRO's and FSDP's sharded 1/(dp cp) (split tp ways first under tp x cp).
"""

import math

from lmforge.accounting import memory
from lmforge.accounting.activations import activation_breakdown
from lmforge.config import Config, ModelConfig
from lmforge.config.schema import Degrees
from lmforge.modes import POLICIES, Policy, get_recompute

ACCUMULATOR_BYTES = 4  # dK/dV accumulate in fp32 whatever the activations' dtype


def padded_length(seq_len: int, cp: int, sequence_shards: int = 1) -> int:
    """The sequence length rounded up to a multiple of 2 cp (the zig-zag's chunk count) and, under
    sequence parallelism over `sequence_shards` = tp ranks, of cp tp (each rank's shard of padded / cp
    tokens is then cut tp ways again): a multiple of lcm(2 cp, cp tp) = cp lcm(2, tp)."""
    multiple = cp * math.lcm(2, sequence_shards)
    return -(-seq_len // multiple) * multiple


def ring_attention_bytes(batch: int, kv_heads: int, local_len: int, head_dim: int, cp: int,
                         element_bytes: int) -> dict:
    """Bytes and messages one rank sends for one attention layer's forward and backward."""
    message = 2 * batch * kv_heads * local_len * head_dim
    hops = cp - 1
    grad_hops = cp if cp > 1 else 0
    return {"forward": hops * message * element_bytes,
            "backward": hops * message * element_bytes + grad_hops * message * ACCUMULATOR_BYTES,
            "sends_forward": hops, "sends_backward": hops + grad_hops}


def context_parallel_bytes(cfg: ModelConfig, batch: int, seq_len: int, cp: int, element_bytes: int,
                           recompute: str = "none", tp: int = 1, sequence_parallel: bool = False) -> dict:
    """ring_attention_bytes summed over the model's layers, for a (batch, seq_len) micro-batch;
    under train.recompute=`recompute` a mode that reruns attention sends the forward twice; with
    parallel.tp=`tp` each rank's ring carries its own kv_heads / tp heads (one, a copy, with fewer
    KV heads than tp ranks: parallel/tp.py), on the whole cp shard (gathered first under
    `sequence_parallel`, whose padding to a multiple of cp tp the shard's length follows)."""
    shards = tp if sequence_parallel else 1
    layer = ring_attention_bytes(batch, max(cfg.kv_heads // tp, 1), padded_length(seq_len, cp, shards) // cp,
                                 cfg.head_dim, cp, element_bytes)
    mode = get_recompute(recompute)
    forwards = 2 if mode.blocks or mode.attention_cores else 1
    layer = {**layer, "forward": forwards * layer["forward"], "sends_forward": forwards * layer["sends_forward"]}
    return {key: cfg.n_layers * value for key, value in layer.items()}


# ContextParallelLoss (parallel/cp_model.py) divides the summed loss by the group's fp32 target
# count, which the division keeps (4 bytes). The plain summed cross-entropy also keeps its fp32
# total weight, which memory.py's one-process count leaves out (tests/test_memory.py allows those 8
# bytes); the vocabulary-parallel sum (tp x cp) keeps no int64 count, which the mean's count has.
GROUP_COUNT_BYTES = 4
CROSS_ENTROPY_WEIGHT_BYTES = 4  # fp32
MEAN_COUNT_BYTES = 8  # int64: memory.vocab_parallel_head_and_loss's last term


def ring_activation_breakdown(cfg: ModelConfig, batch: int, seq_len: int, cp: int,
                              policy: Policy = POLICIES["fp32"], recompute: str = "none", tp: int = 1,
                              fp32_attention: bool = False, sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes one of the cp ranks saves for backward over a (batch, seq_len) micro-batch, by the
    parts of memory.activation_breakdown at the rank's n = padded / cp tokens (two zig-zag chunks
    of padded / 2cp). The ring (RingAttention in parallel/cp.py) keeps what a fused kernel keeps,
    of this rank's shard only: Q, K, V, O and the fp32 log-sum-exp (no K/V of other ranks, no fp32
    accumulator: O is cast to the inputs' dtype, dK/dV accumulate in backward). Three terms differ:

      - its output is (b, h, n, d) and the output projection reads it transposed, a copy, where
        sdpa's output is already laid out (b, n, h d) and is the tensor it keeps;
      - ShardRotaryTables gathers the cos/sin rows of the shard's positions (2 n d_head fp32)
        instead of slicing the whole tables;
      - the group's loss keeps its fp32 target count, and its summed cross-entropy differs in the
        scalars it keeps (the constants above).

    With tp (tp x cp) each rank has its heads' share of all that, as tensor parallelism alone gives
    it; with `sequence_parallel` too, its 1/tp of the shard's norms and residual stream (memory.py's
    sequence-parallel terms at n tokens, n padded to a multiple of tp), while attention, after the
    all-gather, keeps its heads' share of all n tokens as without it."""
    n = padded_length(seq_len, cp, tp if sequence_parallel else 1) // cp
    mode, p = get_recompute(recompute), policy.bytes
    parts = activation_breakdown(cfg, batch, n, policy, "sdpa", recompute, tp, fp32_attention,
                                 sequence_parallel=sequence_parallel)
    # memory.layer_activation_breakdown's shares_kernel_output, which the ring's output never does
    sdpa_shares = p.linear_input == p.compute and not (fp32_attention and p.compute < 4)
    copy = batch * n * cfg.n_heads * cfg.head_dim * p.linear_input / tp if sdpa_shares else 0
    if mode.blocks:  # the block rerun in backward holds one layer's activations again
        parts["recomputed_layer"] += copy
    elif not mode.attention_cores:  # a recomputed core keeps its inputs only: no output of its own
        parts["layers"] += cfg.n_layers * copy
    if parts["rope_tables"]:
        parts["rope_tables"] = 2 * n * cfg.head_dim * 4
    parts["head_and_loss"] += GROUP_COUNT_BYTES + (-MEAN_COUNT_BYTES if tp > 1 else CROSS_ENTROPY_WEIGHT_BYTES)
    return parts


# -- the plan's context-parallel figures ---------------------------------------------------------
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


def context_parallel_section(cfg: Config, d: Degrees, rank_step_flops: float, flops_per_token: float) -> dict:
    """plan["context_parallel"]: the split, the tokens and model FLOPs of each rank (`rank_step_flops`: the
    zig-zag gives every rank the same causal work: docs/context-parallel.md), and the mesh."""
    shards, s, cp = sequence_shards(cfg), cfg.seq_len, d.cp
    padded, n = padded_length(s, cp, shards), local_tokens(s, cp, shards)
    return {
        "cp": cp, "mesh": f"dp {d.dp} x cp {cp} x tp {d.tp}",
        "padded_seq_len": padded, "chunks": 2 * cp, "chunk_tokens": padded // (2 * cp),
        "tokens_per_rank_per_sequence": n,
        "tokens_per_rank_per_step": cfg.train.batch_size * n * cfg.train.grad_accum,
        "training_flops_per_rank_per_step": rank_step_flops,
        "training_flops_per_token": flops_per_token,
    }
