"""Context parallelism: ring attention over a zig-zag sequence shard (Liu et al. 2023, "Ring
Attention with Blockwise Transformers"; the FlashAttention-2 recurrence of Dao 2023 across ranks).

Each of the cp ranks of a group holds 1/cp of every sequence's tokens, and so of its Q, K and V.
Attention needs every query against every earlier key, so the K/V blocks travel around the ring:
at step s rank r holds the K/V of rank src = (r - s) mod cp, attends its own queries to them and
passes them on to rank r + 1 while it computes (the send overlaps the work). What makes the
blocks combinable is the log-sum-exp L = log sum_j exp(s_ij) each flash forward returns beside its
normalised output O (kernels/flash_torch.py): two partial results over disjoint key sets merge as

    L = log(exp(L_a) + exp(L_b)),    O = exp(L_a - L) O_a + exp(L_b - L) O_b

(the online softmax of Milakov & Gimelshein 2018, one block at a time), so after cp steps each
rank holds exactly softmax(Q K^T / sqrt(d)) V for its queries, and L over all keys.

Backward (FA2's Algorithm 2 per block) needs only Q, K, V, O, L and dO: with the *global* O and L,
P_ij = exp(s_ij - L_i) is already the final probability, so each K/V block's contribution to dQ,
dK and dV is computed on its own. K/V go around the ring again, and beside them an accumulator of
dK/dV for that block; after cp steps one more hop brings each accumulator home, holding every
rank's contribution. Nothing of size (n x n) is kept, and full attention is never recomputed.

The zig-zag split (the causal load balance of Megatron-LM's CP and of zhuzilin's ring-flash-
attention): a causal query at position p does p + 1 keys of work, so contiguous shards would give
the last rank cp times the first's. Cut the sequence into 2 cp chunks; rank r holds chunks r and
2cp-1-r (an early and a late one). Then against the K/V of rank src (chunks src, 2cp-1-src):

    src == r    both local chunks, causally (local order is global order)   -- the diagonal
    src <  r    all local queries, the first K/V chunk only, no mask        -- one chunk's work
    src >  r    the late local queries only, both K/V chunks, no mask       -- one chunk's work

so every rank does the same work at every step after the first. Causal only; no sliding window.
Lengths not a multiple of 2 cp are padded at the end (`shard_batch`): causal, so no real token
sees a pad, and the pads' targets are ignored by the loss.
"""

from collections import defaultdict

import torch
import torch.distributed as dist

from lmforge.accounting.cp import padded_length
from lmforge.common.errors import LmforgeError
from lmforge.kernels.flash_torch import flash_backward, flash_forward
from lmforge.model.transformer import IGNORE_INDEX

# -- the zig-zag split ------------------------------------------------------------------------------


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions rank holds of a sequence of seq_len (a multiple of 2 cp): chunks rank, 2cp-1-rank."""
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"the zig-zag split needs a length that is a multiple of 2 x cp = {2 * cp}, got {seq_len}")
    chunk = seq_len // (2 * cp)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([early, early + (2 * cp - 1 - 2 * rank) * chunk])


def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank's shard of x along `dim` (its length a multiple of 2 cp)."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank, device=x.device))


def shard_batch(tokens: torch.Tensor, targets: torch.Tensor | None, cp: int, rank: int, sequence_shards: int = 1):
    """(tokens, targets, positions) of rank's shard of a (batch, seq) batch, padded at the end to a
    multiple of 2 cp (and of cp tp under sequence parallelism over `sequence_shards` = tp ranks:
    accounting/cp.py's padded_length): pad tokens are id 0, their targets IGNORE_INDEX (left out of the loss)."""
    pad = padded_length(tokens.shape[1], cp, sequence_shards) - tokens.shape[1]
    tokens = torch.nn.functional.pad(tokens, (0, pad), value=0)
    if targets is not None:
        targets = zigzag_split(torch.nn.functional.pad(targets, (0, pad), value=IGNORE_INDEX), cp, rank)
    return zigzag_split(tokens, cp, rank), targets, zigzag_positions(tokens.shape[1], cp, rank, tokens.device)


# -- one step of the ring: which block attends to which, and the merge ----------------------------


def block_of(rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of rank's queries against src's K/V (see the table above)."""
    half, whole = local_len // 2, slice(0, local_len)
    if src == rank:
        return whole, whole, True
    if src < rank:
        return whole, slice(0, half), False
    return slice(half, local_len), whole, False


def attend_step(q, k, v, rank: int, src: int):
    """(rows, O, L) of one step: the flash forward of rank's queries against src's K/V block, fp32."""
    rows, cols, causal = block_of(rank, src, q.shape[2])
    out, lse = flash_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=causal)
    return rows, out, lse


def merge_step(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> None:
    """Fold one block's (O, L) into the running (O, L) of `rows`, in place (the module docstring)."""
    new_lse = torch.logaddexp(lse[:, :, rows], block_lse)  # -inf before the first block: exp(-inf) = 0
    out[:, :, rows] = (torch.exp(lse[:, :, rows] - new_lse)[..., None] * out[:, :, rows]
                       + torch.exp(block_lse - new_lse)[..., None] * block_out)
    lse[:, :, rows] = new_lse


def grad_step(q, k, v, out, lse, grad_out, rank: int, src: int):
    """(rows, dQ rows, cols, dK cols, dV cols) of one backward step, fp32: src's K/V block's share."""
    rows, cols, causal = block_of(rank, src, q.shape[2])
    dq, dk, dv = flash_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                grad_out[:, :, rows], causal=causal)
    return rows, dq, cols, dk, dv


# -- the ring over a process group ----------------------------------------------------------------


class RingTraffic:
    """Bytes (and sends) this rank has put on the ring, per phase: what accounting/cp.py predicts."""

    def __init__(self):
        self.bytes, self.sends = defaultdict(int), defaultdict(int)

    def count(self, phase: str, tensor: torch.Tensor) -> None:
        self.bytes[phase] += tensor.nbytes
        self.sends[phase] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.sends.clear()


def start_pass(tensor: torch.Tensor, group, traffic: RingTraffic | None, phase: str, tag: int = 0):
    """Send `tensor` to the next rank of the ring and receive the previous rank's into a new tensor;
    returns `wait`, which gives the received tensor. K/V and dK/dV messages travel at once in
    backward: distinct tags keep a backend that matches by tag (gloo) from pairing them wrongly."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group, tag)]
    requests = dist.batch_isend_irecv(ops)
    if traffic is not None:
        traffic.count(phase, tensor)

    def wait() -> torch.Tensor:
        for request in requests:
            request.wait()
        return received

    return wait


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag shard of q (b, h, n, d) against every rank's k, v
    (b, kv_heads, n, d), kv_heads dividing h (grouped-query attention)."""

    @staticmethod
    def forward(ctx, q, k, v, group, traffic):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(cp):
            wait = start_pass(kv, group, traffic, "forward") if step < cp - 1 else None
            merge_step(out, lse, *attend_step(q, kv[0], kv[1], rank, (rank - step) % cp))
            kv = wait() if wait is not None else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # O(n) per rank: the inputs, O and L
        ctx.group, ctx.traffic = group, traffic
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, traffic = ctx.group, ctx.traffic
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grad_kv, wait_grad = torch.zeros(kv.shape, dtype=torch.float32, device=q.device), None
        for step in range(cp):
            wait_kv = start_pass(kv, group, traffic, "backward") if step < cp - 1 else None
            rows, dq, cols, dk, dv = grad_step(q, kv[0], kv[1], out, lse, grad_out, rank, (rank - step) % cp)
            grad_q[:, :, rows] += dq
            # src's dK/dV accumulator follows its K/V around the ring (received while we computed)
            grad_kv = wait_grad() if wait_grad is not None else grad_kv
            grad_kv[0, :, :, cols] += dk
            grad_kv[1, :, :, cols] += dv
            wait_grad = start_pass(grad_kv, group, traffic, "backward", tag=1) if cp > 1 else None
            kv = wait_kv() if wait_kv is not None else kv
        # after cp steps and cp hops, the accumulator of this rank's own K/V is home
        grad_kv = wait_grad() if wait_grad is not None else grad_kv
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


def ring_attention(q, k, v, group, traffic: RingTraffic | None = None) -> torch.Tensor:
    """Ring attention (see the module docstring); q, k, v this rank's zig-zag shard."""
    if q.shape[2] % 2 != 0:
        raise LmforgeError(f"ring attention needs the zig-zag shard's two equal chunks, got a local length "
                           f"of {q.shape[2]}: shard the batch with shard_batch")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    return RingAttention.apply(q, k, v, group, traffic)
