"""The Triton kernels of FlashAttention-2 (Dao 2023, Algorithms 1 and 2). Imported only on demand.

Importing this module imports triton, and `@triton.jit` decides at import time whether the kernels
compile for the GPU or run in Triton's CPU interpreter (TRITON_INTERPRET=1): set that variable
before the first import. lmforge.kernels.flash_triton is the entry point; it checks all this.

Layout: q, out, grad_out (batch, heads, q_len, d_head) and k, v (batch, kv_heads, kv_len, d_head),
contiguous, so element (b, h, t, d) of a tensor with `heads` heads and `length` rows lies at
((b * heads + h) * length + t) * d_head + d. Lengths need not be multiples of the block sizes, nor
d_head a power of two: tiles are padded up to BLOCK_M x BLOCK_D (BLOCK_N x BLOCK_D) and the padding
masked on load and store. Query head h reads key/value head h // group (grouped-query attention):
the kernels index K and V with it, nothing is repeated in memory.

Three kernels, as in FA2's backward split (sec. 3.2): forward (one program per query block and
head), dK/dV (one program per key block and kv head, looping over the query heads of its group
and their query blocks: no atomics) and dQ (one program per query block and head).
UPCAST_TILES casts loaded tiles to fp32 before `tl.dot`: the interpreter's bf16 dot returns garbage,
so the wrapper sets it there; on a GPU bf16 tiles go to the tensor cores as they are.
`window` is the sliding window (flash_torch.py's docstring): the query at position p sees keys
p - window + 1 .. p; without one the wrapper passes q_len + kv_len, wider than any band, so the
same code masks nothing more. Tiles wholly outside the band are skipped, and a row that has seen
no key yet exponentiates against 0 rather than its running max of -inf.
DOT_PRECISION is "ieee" for fp32 inputs (tl.dot would otherwise round fp32 operands to tf32, 10
mantissa bits, on the tensor cores, and fp32 attention would no longer match fp32 matmuls).
"""

import triton
import triton.language as tl


@triton.jit
def _load_tile(base, row_start, length, d_head, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows row_start .. row_start + BLOCK_ROWS of a (length, d_head) matrix, zeros past its edges."""
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < length) & (cols[None, :] < d_head)
    return tl.load(base + rows[:, None] * d_head + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_pair(a_ptr, b_ptr, base, row_start, length, d_head, UPCAST_TILES: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The same rows of two matrices laid out alike (K and V, or Q and dO), both in fp32 when UPCAST_TILES."""
    a = _load_tile(a_ptr + base, row_start, length, d_head, BLOCK_ROWS, BLOCK_D)
    b = _load_tile(b_ptr + base, row_start, length, d_head, BLOCK_ROWS, BLOCK_D)
    if UPCAST_TILES:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return a, b


@triton.jit
def _store_tile(base, tile, row_start, length, d_head, row_stride,
                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < length) & (cols[None, :] < d_head)
    tl.store(base + rows[:, None] * row_stride + cols[None, :], tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _visible(row_start, key_start, q_len, kv_len, window, CAUSAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the tile: the key exists and, if causal, is neither in the future
    nor before the window."""
    rows = row_start + tl.arange(0, BLOCK_M)
    keys = key_start + tl.arange(0, BLOCK_N)
    ok = keys[None, :] < kv_len
    if CAUSAL:
        position = rows[:, None] + (kv_len - q_len)  # end-aligned mask
        ok = ok & (keys[None, :] <= position) & (keys[None, :] > position - window)
    return ok


@triton.jit
def _key_range(row_start, q_len, kv_len, window, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[begin, end) of the keys a query block starting at row_start sees, begin a multiple of BLOCK_N:
    all of them, or if causal, from the first its window reaches to its last row's own position."""
    key_begin, key_end = 0, kv_len
    if CAUSAL:
        key_begin = tl.maximum(row_start + kv_len - q_len - window + 1, 0) // BLOCK_N * BLOCK_N
        key_end = tl.minimum(kv_len, row_start + BLOCK_M + kv_len - q_len)
    return key_begin, key_end


@triton.jit
def flash_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, scale,
                         heads, kv_heads, q_len, kv_len, d_head, window,
                         CAUSAL: tl.constexpr, UPCAST_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    row_start = tl.program_id(0) * BLOCK_M  # Algorithm 1, line 3: this program's query block i
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // (heads // kv_heads)
    q_base = q_ptr + batch_head.to(tl.int64) * q_len * d_head
    kv_base = (batch * kv_heads + kv_head).to(tl.int64) * kv_len * d_head

    q_tile = _load_tile(q_base, row_start, q_len, d_head, BLOCK_M, BLOCK_D)  # line 4
    if UPCAST_TILES:
        q_tile = q_tile.to(tl.float32)
    # Line 5, statistics and accumulator in fp32 on chip.
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Line 6: key blocks up to the last one this query block can see (causal: skip the rest), from
    # the first one its window reaches.
    key_begin, key_end = _key_range(row_start, q_len, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    for key_start in range(key_begin, key_end, BLOCK_N):
        # Line 7: K_j and V_j
        k_tile, v_tile = _load_pair(k_ptr, v_ptr, kv_base, key_start, kv_len, d_head, UPCAST_TILES, BLOCK_N, BLOCK_D)
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale  # line 8
        visible = _visible(row_start, key_start, q_len, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
        scores = tl.where(visible, scores, float("-inf"))
        # Line 9: online softmax. A row that has seen no key yet (one whose window starts in a
        # later block) has a max of -inf: shift by 0 instead, which makes its probabilities 0.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        correction = tl.exp(row_max - shift)
        row_sum = correction * row_sum + tl.sum(probs, axis=1)
        # Line 10: P~ goes to the second matmul in the input dtype, as FA2 does on tensor cores.
        acc = correction[:, None] * acc + tl.dot(probs.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        row_max = new_max
    # Lines 12 and 14. The output is laid out (batch, q_len, heads, d_head), as sdpa returns it, so
    # that the model's output projection reads it without a transposing copy.
    out_base = out_ptr + (batch.to(tl.int64) * q_len * heads + head) * d_head
    # (padding rows past q_len may see no key through a window: a sum of 1 keeps them finite; never stored)
    row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    _store_tile(out_base, acc / row_sum[:, None], row_start, q_len, d_head, heads * d_head, BLOCK_M, BLOCK_D)
    rows = row_start + tl.arange(0, BLOCK_M)
    tl.store(lse_ptr + batch_head.to(tl.int64) * q_len + rows, row_max + tl.log(row_sum),
             mask=rows < q_len)  # lines 13 and 15: L_i


@triton.jit
def flash_backward_dkdv_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr,
                               grad_k_ptr, grad_v_ptr, scale,
                               heads, kv_heads, q_len, kv_len, d_head, window,
                               CAUSAL: tl.constexpr, UPCAST_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    key_start = tl.program_id(0) * BLOCK_N  # Algorithm 2, line 5: this program's key block j
    batch_kv_head = tl.program_id(1)
    batch, kv_head = batch_kv_head // kv_heads, batch_kv_head % kv_heads
    group = heads // kv_heads
    kv_base = batch_kv_head.to(tl.int64) * kv_len * d_head
    # Line 6: K_j and V_j
    k_tile, v_tile = _load_pair(k_ptr, v_ptr, kv_base, key_start, kv_len, d_head, UPCAST_TILES, BLOCK_N, BLOCK_D)
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # line 7
    grad_v = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: query rows before key_start - (kv_len - q_len) see none of these keys.
    # With a window, rows from key_start + BLOCK_N - 1 + window - (kv_len - q_len) on have passed them.
    first_row, row_end = 0, q_len
    if CAUSAL:
        first_row = tl.maximum(key_start - (kv_len - q_len), 0) // BLOCK_M * BLOCK_M
        row_end = tl.minimum(q_len, key_start + BLOCK_N - 1 + window - (kv_len - q_len))
    # Every query head of the group reads this kv head, so its gradient sums over all of them.
    for member in range(0, group):
        batch_head = batch * heads + kv_head * group + member
        q_base = batch_head.to(tl.int64) * q_len * d_head
        for row_start in range(first_row, row_end, BLOCK_M):  # line 8
            q_tile, grad_out = _load_pair(q_ptr, grad_out_ptr, q_base, row_start, q_len, d_head, UPCAST_TILES,
                                          BLOCK_M, BLOCK_D)  # line 9
            rows = row_start + tl.arange(0, BLOCK_M)
            lse = tl.load(lse_ptr + batch_head.to(tl.int64) * q_len + rows, mask=rows < q_len, other=0.0)
            delta = tl.load(delta_ptr + batch_head.to(tl.int64) * q_len + rows, mask=rows < q_len, other=0.0)
            scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale  # line 10
            visible = _visible(row_start, key_start, q_len, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
            # Line 11: P = exp(S - L), already normalised. Padded rows have zero dO and Q, so they
            # add nothing below; masked keys get P = 0.
            probs = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)
            grad_v += tl.dot(tl.trans(probs.to(grad_out.dtype)), grad_out, input_precision=DOT_PRECISION)  # line 12
            grad_probs = tl.dot(grad_out, tl.trans(v_tile), input_precision=DOT_PRECISION)  # line 13
            grad_scores = probs * (grad_probs - delta[:, None])  # line 14
            grad_k += tl.dot(tl.trans(grad_scores.to(q_tile.dtype)), q_tile, input_precision=DOT_PRECISION)  # line 16
    _store_tile(grad_k_ptr + kv_base, grad_k * scale, key_start, kv_len, d_head, d_head, BLOCK_N, BLOCK_D)  # line 18
    _store_tile(grad_v_ptr + kv_base, grad_v, key_start, kv_len, d_head, d_head, BLOCK_N, BLOCK_D)


@triton.jit
def flash_backward_dq_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_q_ptr, scale,
                             heads, kv_heads, q_len, kv_len, d_head, window,
                             CAUSAL: tl.constexpr, UPCAST_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Algorithm 2, line 15 accumulates dQ_i with atomic adds across key blocks; like FA2's own
    # implementation we instead give each query block its own program that walks the key blocks.
    row_start = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // (heads // kv_heads)
    q_base = batch_head.to(tl.int64) * q_len * d_head
    kv_base = (batch * kv_heads + kv_head).to(tl.int64) * kv_len * d_head
    q_tile, grad_out = _load_pair(q_ptr, grad_out_ptr, q_base, row_start, q_len, d_head, UPCAST_TILES, BLOCK_M, BLOCK_D)
    rows = row_start + tl.arange(0, BLOCK_M)
    lse = tl.load(lse_ptr + batch_head.to(tl.int64) * q_len + rows, mask=rows < q_len, other=0.0)
    delta = tl.load(delta_ptr + batch_head.to(tl.int64) * q_len + rows, mask=rows < q_len, other=0.0)
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_begin, key_end = _key_range(row_start, q_len, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    for key_start in range(key_begin, key_end, BLOCK_N):
        k_tile, v_tile = _load_pair(k_ptr, v_ptr, kv_base, key_start, kv_len, d_head, UPCAST_TILES, BLOCK_N, BLOCK_D)
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale
        visible = _visible(row_start, key_start, q_len, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
        probs = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)
        grad_probs = tl.dot(grad_out, tl.trans(v_tile), input_precision=DOT_PRECISION)
        grad_scores = probs * (grad_probs - delta[:, None])
        grad_q += tl.dot(grad_scores.to(k_tile.dtype), k_tile, input_precision=DOT_PRECISION)
    _store_tile(grad_q_ptr + q_base, grad_q * scale, row_start, q_len, d_head, d_head, BLOCK_M, BLOCK_D)
