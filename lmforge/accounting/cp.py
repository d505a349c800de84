"""Bytes each rank sends around the context-parallel ring (parallel/cp.py), per attention layer and
per step: pure arithmetic from the shapes, checked against the bytes the ring really sends.

With cp ranks, a sequence padded to a multiple of 2 cp and n = padded / cp tokens per rank, one
K/V message is K and V of the local shard: M = 2 b kv_heads n d_head elements. Per layer per rank:

    forward    (cp - 1) messages of M in the activations' dtype (each rank's K/V visits the others)
    backward   (cp - 1) of M again (K/V go round once more: nothing of other ranks is kept)
             + cp of M in fp32: the dK/dV accumulator travels with its K/V and hops home at the end

cp = 1 sends nothing. Grouped-query attention shrinks M by heads / kv_heads: the ring carries
KV heads, not query heads. Recomputation (wrap/recompute, selective or full) reruns attention's
forward in backward, and with it the ring's forward: `recompute` counts those messages twice (the
backward's own are unchanged: the rerun forward keeps no state the backward ring would skip).
The loss count and the
gradient all-reduce across the CP group are collectives of parallel/comm.py, counted there.
"""

from lmforge.config import ModelConfig
from lmforge.modes.recompute import get_recompute

ACCUMULATOR_BYTES = 4  # dK/dV accumulate in fp32 whatever the activations' dtype


def padded_length(seq_len: int, cp: int) -> int:
    """The sequence length rounded up to a multiple of 2 cp (the zig-zag's chunk count)."""
    return -(-seq_len // (2 * cp)) * (2 * cp)


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
                           recompute: str = "none", tp: int = 1) -> dict:
    """ring_attention_bytes summed over the model's layers, for a (batch, seq_len) micro-batch;
    under train.recompute=`recompute` a mode that reruns attention sends the forward twice; with
    parallel.tp=`tp` each rank's ring carries its own kv_heads / tp heads."""
    layer = ring_attention_bytes(batch, cfg.kv_heads // tp, padded_length(seq_len, cp) // cp, cfg.head_dim, cp,
                                 element_bytes)
    mode = get_recompute(recompute)
    forwards = 2 if mode.blocks or mode.attention_cores else 1
    layer = {**layer, "forward": forwards * layer["forward"], "sends_forward": forwards * layer["sends_forward"]}
    return {key: cfg.n_layers * value for key, value in layer.items()}
