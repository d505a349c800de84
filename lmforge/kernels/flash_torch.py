"""FlashAttention-2 forward and backward in plain PyTorch, tile by tile (Dao 2023, Algorithms 1 and 2).

Standard attention writes the (q_len x kv_len) score matrix S = Q K^T and its softmax P to memory
and keeps P for backward: O(N^2) memory. FlashAttention never holds more than one (block_q x
block_k) tile of S at a time:

  forward   each block of query rows walks the key/value blocks, keeping a running row maximum m
            and running row sum l of exp(S - m) (the online softmax, Milakov & Gimelshein 2018) and
            rescaling the partial output whenever m grows. It saves only O and the row
            log-sum-exp L = m + log(l) for backward.
  backward  recomputes each tile P = exp(S - L) from Q, K and L (no softmax needed: L already
            holds the normaliser) and accumulates dQ, dK, dV, using D = rowsum(dO * O), which
            equals rowsum(P * dP) and so replaces the softmax Jacobian's row sum.

This is a teaching version: the Python loops make the algorithm visible, and on CPU it is slower
than the fused `sdpa` kernel (see bench/RESULTS.md). Its point is the memory: what autograd keeps
is Q, K, V, O and L, linear in the sequence length.

Conventions match lmforge.model.attention: q (batch, heads, q_len, d_head), k and v
(batch, kv_heads, kv_len, d_head), heads a multiple of kv_heads (grouped-query attention), causal
mask aligned to the end of the keys (query i sits at position kv_len - q_len + i). Grouped-query
attention is done by broadcasting: the queries are viewed as (batch, kv_heads, group, q_len,
d_head) and each key/value tile as (batch, kv_heads, 1, block_k, d_head), so the repeated K and V
are never materialised. Ragged last tiles are simply shorter slices; no padding is needed here.
A sliding window w (model/attention.py) narrows the causal mask to a band: query position p sees
keys p - w + 1 .. p. The loops then also skip the tiles wholly outside the band, so the work per
query is O(w) instead of O(kv_len); a row whose keys all lie in later tiles keeps a running max
of -inf until it meets them, and its exponentials are taken against 0 meanwhile (as FA2's
kernels do) rather than -inf - -inf = nan.
All tile arithmetic runs in fp32 (softmax statistics and accumulators) whatever the input dtype;
only O, dQ, dK, dV are cast back to it.
"""

import math

import torch

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


def flash_attention_torch(q, k, v, *, causal=True, window=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Attention output (batch, heads, q_len, d_head), computed tile by tile; differentiable."""
    check_flash_inputs(q, k, v, causal=causal, block_q=block_q, block_k=block_k, window=window)
    return FlashAttentionTorch.apply(q, k, v, causal, block_q, block_k, window)


def check_flash_inputs(q, k, v, *, causal, block_q, block_k, window=None):
    """Shape rules shared by both flash backends; raises ValueError naming the problem."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash attention expects 4-d q, k, v (batch, heads, len, d_head), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dimension")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and q.shape[2] > k.shape[2]:
        # End-aligned: the first q_len - kv_len queries would see no key at all (an empty softmax).
        raise ValueError(f"causal attention needs q_len <= kv_len, got {q.shape[2]} > {k.shape[2]}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal=True and a size >= 1, got causal={causal}, window={window}")


def visible_key_end(row_end: int, q_len: int, kv_len: int, causal: bool) -> int:
    """One past the last key any query row before `row_end` may see (end-aligned causal mask)."""
    return min(kv_len, row_end + kv_len - q_len) if causal else kv_len


def first_visible_key(row_start: int, q_len: int, kv_len: int, window: int | None) -> int:
    """First key row `row_start` sees through a sliding window (later rows see only later keys)."""
    return 0 if window is None else max(0, row_start + kv_len - q_len - window + 1)


def first_visible_row(key_start: int, q_len: int, kv_len: int, causal: bool) -> int:
    """First query row that sees key `key_start`: rows above it skip this key block entirely."""
    return max(0, key_start - (kv_len - q_len)) if causal else 0


def visible_row_end(key_end: int, q_len: int, kv_len: int, window: int | None) -> int:
    """One past the last query row whose window still reaches key `key_end - 1`."""
    return q_len if window is None else min(q_len, key_end - 1 + window - (kv_len - q_len))


def tile_scores(q_tile, k_tile, scale, row_start, row_end, key_start, key_end, q_len, kv_len, causal, window):
    """The tile's scaled scores S = Q_i K_j^T, -inf where the query may not attend (the causal mask,
    and the sliding window's band); no mask at all on a tile whose every key every row sees."""
    scores = (q_tile @ k_tile.transpose(-1, -2)) * scale
    offset = kv_len - q_len  # query i sits at absolute position i + offset
    before_all = key_end - 1 <= row_start + offset  # the tile's last key is visible to its first row
    in_all_windows = window is None or key_start > row_end - 1 + offset - window  # its first key, to its last row
    if not causal or before_all and in_all_windows:
        return scores
    rows = torch.arange(row_start, row_end, device=scores.device)[:, None] + offset
    keys = torch.arange(key_start, key_end, device=scores.device)[None, :]
    visible = (keys <= rows) if window is None else (keys <= rows) & (keys > rows - window)
    return scores.masked_fill(~visible, float("-inf"))


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """View (batch, heads, len, d) as (batch, kv_heads, group, len, d): query head h = g * group + r."""
    batch, heads, length, d_head = x.shape
    return x.view(batch, kv_heads, heads // kv_heads, length, d_head)


def flash_forward(q, k, v, *, causal, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, window=None):
    """Algorithm 1: (O, L), both fp32, O (batch, heads, q_len, d_head) and L (batch, heads, q_len).
    A building block: FlashAttentionTorch and ring attention (parallel/cp.py) call it."""
    batch, heads, q_len, d_head = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d_head)
    # Work in fp32: the statistics m, l and the accumulator must not round (Dao 2023, sec. 3.1.1).
    q5 = grouped(q.contiguous(), kv_heads).float()
    k5 = k.float().unsqueeze(2)  # (batch, kv_heads, 1, kv_len, d): broadcast over the group
    v5 = v.float().unsqueeze(2)
    out = torch.empty_like(q5)
    lse = torch.empty(q5.shape[:-1], dtype=torch.float32, device=q.device)

    # Algorithm 1, line 3: one pass per block of query rows (in a GPU kernel, one thread block each).
    for row_start in range(0, q_len, block_q):
        row_end = min(row_start + block_q, q_len)
        q_tile = q5[:, :, :, row_start:row_end]  # line 4: Q_i
        # Line 5: O_i = 0, l_i = 0, m_i = -inf.
        acc = torch.zeros_like(q_tile)
        row_sum = torch.zeros(q_tile.shape[:-1], dtype=torch.float32, device=q.device)
        row_max = torch.full_like(row_sum, float("-inf"))
        # Line 6: the key/value blocks; with a causal mask, blocks wholly above the diagonal
        # (every key later than every query of this block) are skipped, halving the work, and
        # with a sliding window those wholly before the band.
        first_key = first_visible_key(row_start, q_len, kv_len, window) // block_k * block_k
        for key_start in range(first_key, visible_key_end(row_end, q_len, kv_len, causal), block_k):
            key_end = min(key_start + block_k, kv_len)
            k_tile, v_tile = k5[..., key_start:key_end, :], v5[..., key_start:key_end, :]  # line 7
            # Line 8: S_i^(j) = Q_i K_j^T, masked
            scores = tile_scores(q_tile, k_tile, scale, row_start, row_end, key_start, key_end, q_len, kv_len,
                                 causal, window)
            # Line 9: new running max; exp(S - m_new) is at most 1, so it cannot overflow. A row
            # that has seen no key yet (a sliding window's) exponentiates against 0: all zeros.
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = torch.exp(scores - shift[..., None])  # P~_i^(j), unnormalised
            correction = torch.exp(row_max - shift)  # e^(m^(j-1) - m^(j)); 0 on the first block
            row_sum = correction * row_sum + probs.sum(dim=-1)
            # Line 10: rescale what was accumulated under the old max, then add this block.
            acc = correction[..., None] * acc + probs @ v_tile
            row_max = new_max
        # Line 12: divide by the row sum once at the end (FA2's tweak: not at every block).
        out[:, :, :, row_start:row_end] = acc / row_sum[..., None]
        # Line 13: L_i = m_i + log(l_i), all backward needs to rebuild P.
        lse[:, :, :, row_start:row_end] = row_max + torch.log(row_sum)

    return out.view(batch, heads, q_len, d_head), lse.view(batch, heads, q_len)


def flash_backward(q, k, v, out, lse, grad_out, *, causal, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                   window=None):
    """Algorithm 2: (dQ, dK, dV) in fp32 from the inputs, O and L. With the O and L of attention over
    more keys than k holds (ring attention), these are exactly the gradients through k's keys."""
    batch, heads, q_len, d_head = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d_head)
    q5 = grouped(q.contiguous(), kv_heads).float()
    k5, v5 = k.float().unsqueeze(2), v.float().unsqueeze(2)
    do5 = grouped(grad_out.contiguous(), kv_heads).float()
    lse5 = lse.view(batch, kv_heads, heads // kv_heads, q_len)
    # Algorithm 2, line 4: D_i = rowsum(dO_i * O_i). Since O = P V, this equals rowsum(P * dP),
    # the term the softmax backward dS = P * (dP - rowsum(P * dP)) needs (eq. in sec. 2.3.1).
    delta = (do5 * grouped(out, kv_heads).float()).sum(dim=-1)
    grad_q = torch.zeros_like(q5)
    grad_k = torch.zeros(batch, kv_heads, kv_len, d_head, dtype=torch.float32, device=q.device)
    grad_v = torch.zeros_like(grad_k)

    # Line 5: one pass per key/value block (a GPU kernel keeps dK_j, dV_j on chip meanwhile).
    for key_start in range(0, kv_len, block_k):
        key_end = min(key_start + block_k, kv_len)
        k_tile, v_tile = k5[..., key_start:key_end, :], v5[..., key_start:key_end, :]  # line 6
        grad_k_tile = torch.zeros_like(k_tile.squeeze(2))  # line 7: dK_j = 0, dV_j = 0
        grad_v_tile = torch.zeros_like(grad_k_tile)
        # Line 8: query blocks; causal rows that see none of these keys are skipped, and rows
        # whose window has moved past them.
        first_row = first_visible_row(key_start, q_len, kv_len, causal) // block_q * block_q
        for row_start in range(first_row, visible_row_end(key_end, q_len, kv_len, window), block_q):
            row_end = min(row_start + block_q, q_len)
            rows = slice(row_start, row_end)
            q_tile, do_tile = q5[:, :, :, rows], do5[:, :, :, rows]  # line 9
            # Lines 10-11: recompute the probabilities from L, already normalised.
            scores = tile_scores(q_tile, k_tile, scale, row_start, row_end, key_start, key_end, q_len, kv_len,
                                 causal, window)
            probs = torch.exp(scores - lse5[:, :, :, rows, None])
            # Line 12: dV_j += P^T dO_i, summed over the query heads sharing this kv head.
            grad_v_tile += (probs.transpose(-1, -2) @ do_tile).sum(dim=2)
            grad_probs = do_tile @ v_tile.transpose(-1, -2)  # line 13: dP = dO_i V_j^T
            grad_scores = probs * (grad_probs - delta[:, :, :, rows, None])  # line 14: dS
            # Line 15: dQ_i += dS K_j (times the 1/sqrt(d) folded into S). On a GPU this is the
            # atomic add; here it is a plain in-place add.
            grad_q[:, :, :, rows] += (grad_scores @ k_tile) * scale
            grad_k_tile += (grad_scores.transpose(-1, -2) @ q_tile).sum(dim=2) * scale  # line 16
        grad_k[:, :, key_start:key_end] = grad_k_tile  # line 18
        grad_v[:, :, key_start:key_end] = grad_v_tile

    return grad_q.view(batch, heads, q_len, d_head), grad_k, grad_v


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k, window):
        out, lse = flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k, window=window)
        # Returned as a (batch, heads, q_len, d_head) view of (batch, q_len, heads, d_head) memory, the
        # layout sdpa returns too: the model's "b h t d -> b t (h d)" before the output projection is
        # then free, and that projection saves this same storage instead of a copy of it.
        out = out.transpose(1, 2).contiguous().to(q.dtype).transpose(1, 2)
        # Saved for backward: the inputs, O (input dtype) and L (fp32): O(N), never an N x N tensor.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k, ctx.window = causal, block_q, block_k, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = flash_backward(q, k, v, out, lse, grad_out, causal=ctx.causal, block_q=ctx.block_q,
                                                block_k=ctx.block_k, window=ctx.window)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None
