"""Context parallelism without a process group: the zig-zag split, and the ring's block recurrence
(parallel/cp.py's attend_step, merge_step and grad_step) played out in one process, every rank in
lockstep, against naive attention. The real ring over gloo is tests/test_cp_dist.py.

Tolerance, fp32: the ring sums the same softmax terms as naive attention in another order (per
key block, merged through log-sum-exp), so outputs and gradients agree to float rounding, ~1e-6
relative here (measured max |diff| 1.4e-6 on values of order 1); we check atol = rtol = 1e-5.
A block skipped, a wrong mask or a wrong merge moves outputs by ~1e-1 (a whole key chunk's weight).
"""

import pytest
import torch

from lmforge.accounting.cp import ring_attention_bytes
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.model.attention import naive_attention
from lmforge.model.transformer import IGNORE_INDEX, Transformer
from lmforge.parallel.cp import (attend_step, block_of, grad_step, merge_step, padded_length, shard_batch,
                                 zigzag_positions, zigzag_split)
from lmforge.parallel.cp_model import ContextParallel, apply_context_parallel

TOL = dict(atol=1e-5, rtol=1e-5)


def zigzag_unsplit(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's shard, in rank order (inverse of zigzag_split)."""
    cp = len(shards)
    chunks = [shard.chunk(2, dim=dim) for shard in shards]
    return torch.cat([chunks[r][0] for r in range(cp)] + [chunks[r][1] for r in reversed(range(cp))], dim=dim)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_round_trips_and_positions_cover_the_sequence(cp):
    x = torch.randn(2, 8 * cp, 3)
    shards = [zigzag_split(x, cp, r) for r in range(cp)]
    assert torch.equal(zigzag_unsplit(shards), x)
    positions = torch.cat([zigzag_positions(8 * cp, cp, r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(8 * cp))  # every position once
    for r in range(cp):  # the shard holds exactly the tokens at its positions
        assert torch.equal(shards[r], x[:, zigzag_positions(8 * cp, cp, r)])


def test_zigzag_chunks_are_an_early_and_a_late_one():
    # 16 tokens, cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="multiple of 2 x cp = 4"):
        zigzag_positions(10, 2, 0)


def test_shard_batch_pads_at_the_end_with_ignored_targets():
    tokens = torch.arange(1, 11).view(1, 10)  # 10 tokens, cp = 2: padded to 12
    targets = tokens + 100
    assert padded_length(10, 2) == 12 and padded_length(12, 2) == 12
    shards = [shard_batch(tokens, targets, 2, r) for r in range(2)]
    assert torch.equal(zigzag_unsplit([s[0] for s in shards]), torch.tensor([[*range(1, 11), 0, 0]]))
    assert torch.equal(zigzag_unsplit([s[1] for s in shards]),
                       torch.tensor([[*range(101, 111), IGNORE_INDEX, IGNORE_INDEX]]))
    assert shards[0][2].tolist() == [0, 1, 2, 9, 10, 11] and shards[1][2].tolist() == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_does_the_same_work_after_the_diagonal(cp):
    n = 8  # local length: two chunks of 4
    for rank in range(cp):
        for src in range(cp):
            rows, cols, causal = block_of(rank, src, n)
            work = (rows.stop - rows.start) * (cols.stop - cols.start)
            assert causal == (src == rank) and (causal or work == n * n // 2)


def simulate_ring(q, k, v, cp):
    """Every rank's (O, L) through the ring, in one process: at step s rank r holds src (r - s)'s K/V."""
    qs, ks, vs = ([zigzag_split(t, cp, r, dim=2) for r in range(cp)] for t in (q, k, v))
    outs = [torch.zeros(qs[r].shape) for r in range(cp)]
    lses = [torch.full(qs[r].shape[:-1], float("-inf")) for r in range(cp)]
    for step in range(cp):
        for r in range(cp):
            merge_step(outs[r], lses[r], *attend_step(qs[r], ks[(r - step) % cp], vs[(r - step) % cp], r,
                                                      (r - step) % cp))
    return qs, ks, vs, outs, lses


def simulate_ring_backward(qs, ks, vs, outs, lses, grad_outs, cp):
    """dQ, dK, dV of every rank: each K/V block's share from every rank, summed where it belongs."""
    grad_q = [torch.zeros(t.shape) for t in qs]
    grad_k, grad_v = [torch.zeros(t.shape) for t in ks], [torch.zeros(t.shape) for t in vs]
    for step in range(cp):
        for r in range(cp):
            src = (r - step) % cp
            rows, dq, cols, dk, dv = grad_step(qs[r], ks[src], vs[src], outs[r], lses[r], grad_outs[r], r, src)
            grad_q[r][:, :, rows] += dq
            grad_k[src][:, :, cols] += dk
            grad_v[src][:, :, cols] += dv
    return [zigzag_unsplit(g, dim=2) for g in (grad_q, grad_k, grad_v)]


@pytest.mark.parametrize("cp,heads,kv_heads,seq", [(1, 4, 4, 8), (2, 4, 4, 16), (2, 4, 2, 24), (4, 6, 2, 32),
                                                   (3, 2, 1, 12)])
def test_simulated_ring_equals_naive_attention_forward_and_backward(cp, heads, kv_heads, seq):
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, requires_grad=True)
    reference = naive_attention(q, k, v, causal=True)
    grad_out = torch.randn_like(reference)
    reference.backward(grad_out)

    qs, ks, vs, outs, lses = simulate_ring(q.detach(), k.detach(), v.detach(), cp)
    torch.testing.assert_close(zigzag_unsplit(outs, dim=2), reference.detach(), **TOL)
    # L over every visible key: log of the causal mask (0 or -inf) plus the scores, log-sum-exp'd
    scores = q.detach() @ k.detach().repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) / 8 ** 0.5
    full_lse = torch.logsumexp(torch.tril(torch.ones(seq, seq)).log() + scores, dim=-1)
    torch.testing.assert_close(zigzag_unsplit(lses, dim=2), full_lse, **TOL)
    grad_outs = [zigzag_split(grad_out, cp, r, dim=2) for r in range(cp)]
    grads = simulate_ring_backward(qs, ks, vs, outs, lses, grad_outs, cp)
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref, **TOL)


def test_a_ring_that_skips_a_block_is_wrong():
    """The check above can fail: leave out one step's block and the outputs move far past TOL."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    cp = 2
    qs, ks, vs = ([zigzag_split(t, cp, r, dim=2) for r in range(cp)] for t in (q, k, v))
    outs = [torch.zeros(t.shape) for t in qs]
    lses = [torch.full(t.shape[:-1], float("-inf")) for t in qs]
    for r in range(cp):
        merge_step(outs[r], lses[r], *attend_step(qs[r], ks[r], vs[r], r, r))  # only the diagonal
    error = (zigzag_unsplit(outs, dim=2) - naive_attention(q, k, v, causal=True)).abs().max()
    assert error > 0.05


def test_ring_bytes_formula():
    # b=2, kv_heads=2, local n=8, d=4, fp32 K/V: one K/V message is 2 * 2*2*8*4 * 4 bytes = 1024
    one = 2 * 2 * 2 * 8 * 4 * 4
    got = ring_attention_bytes(batch=2, kv_heads=2, local_len=8, head_dim=4, cp=4, element_bytes=4)
    assert got == {"forward": 3 * one, "backward": 3 * one + 4 * one, "sends_forward": 3, "sends_backward": 7}
    assert ring_attention_bytes(batch=2, kv_heads=2, local_len=8, head_dim=4, cp=1, element_bytes=4) == {
        "forward": 0, "backward": 0, "sends_forward": 0, "sends_backward": 0}


def test_ring_bytes_of_a_model_under_recomputation_and_tensor_parallelism():
    from lmforge.accounting.cp import context_parallel_bytes
    cfg = make_config("tiny").model  # 2 layers, 2 KV heads: at seq 29 (padded to 32), cp 2 (16 tokens), one K/V
    one = 2 * 1 * 2 * 16 * cfg.head_dim * 4  # message is 2 * b * kv_heads * 16 * d_head fp32 elements
    plain = context_parallel_bytes(cfg, 1, 29, 2, 4)
    assert plain == {"forward": 2 * one, "backward": 2 * (one + 2 * one), "sends_forward": 2, "sends_backward": 6}
    for mode in ("selective", "full"):  # the rerun forward sends K/V round the ring again
        assert context_parallel_bytes(cfg, 1, 29, 2, 4, recompute=mode) == {
            **plain, "forward": 2 * plain["forward"], "sends_forward": 2 * plain["sends_forward"]}
    halved = context_parallel_bytes(cfg, 1, 29, 2, 4, tp=2)  # each tp rank's ring: its one KV head
    assert halved == {**{k: v // 2 for k, v in plain.items() if not k.startswith("sends")},
                      **{k: v for k, v in plain.items() if k.startswith("sends")}}


@pytest.mark.parametrize("override,message", [("model.sliding_window=8", "does not support a sliding window"),
                                              ("model.dropout=0.1", "needs model.dropout=0")])
def test_apply_context_parallel_refuses_what_the_ring_cannot_do(override, message):
    model = Transformer(make_config("tiny", overrides=[override]).model)
    with pytest.raises(LmforgeError, match=message):
        apply_context_parallel(model, group=None)  # refused before the group is asked anything


def test_shard_refuses_a_sequence_longer_than_the_model():
    cp = ContextParallel(group=None, cp=2, rank=0, max_seq_len=8)
    assert cp.shard(torch.zeros(1, 7, dtype=torch.long))[0].shape == (1, 4)  # padded to 8, half of it
    with pytest.raises(LmforgeError, match="sequence length 9 exceeds model.max_seq_len 8"):
        cp.shard(torch.zeros(1, 9, dtype=torch.long))


# -- the trainer's launch check and mesh (parallel/world.py, parallel/mesh.py) --------------------

CP = ["parallel.cp=2", "train.parallel=ddp", "train.sample_tokens=0"]


@pytest.mark.parametrize("overrides, env, message", [
    (CP, None, "parallel.cp=2 needs 2 processes per model replica"),
    (CP, (0, 3, 0), "the world must be (replicas x cp x tp), a multiple of 2"),
    ([*CP, "parallel.tp=2"], (0, 6, 0), "the world must be (replicas x cp x tp), a multiple of 4"),
    ([*CP, "train.parallel=none"], (0, 2, 0), "set train.parallel=ddp, zero1, zero2, zero3 or fsdp"),
    ([*CP, "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=fp8"], (0, 4, 0),
     "parallel.tp=2 does not combine with train.precision"),
    ([*CP, "parallel.pp=2"], (0, 4, 0), "does not combine with parallel.pp"),
    ([*CP, "model.dropout=0.1"], (0, 2, 0), "does not combine with model.dropout"),
    ([*CP, "model.sliding_window=8"], (0, 2, 0), "does not combine with model.sliding_window"),
    ([*CP, "train.loss_chunk_tokens=64"], (0, 2, 0), "does not combine with train.loss_chunk_tokens"),
    (["parallel.cp=2", "train.parallel=ddp"], (0, 2, 0), "set train.sample_tokens=0"),
    ([*CP, "train.seq_len=3"], (0, 2, 0), "(lengths that are not a multiple are padded): use train.seq_len >= 4"),
])
def test_launch_refuses_what_context_parallelism_cannot_run(overrides, env, message):
    from lmforge.parallel.world import check_launch
    with pytest.raises(LmforgeError) as err:
        check_launch(make_config("tiny", overrides=overrides), env, cuda_devices=0)
    assert message in str(err.value)


def test_launch_accepts_cp_times_dp_at_a_length_that_is_padded():
    from lmforge.parallel.world import check_launch
    cfg = make_config("tiny", overrides=[*CP, "train.seq_len=29"])
    assert check_launch(cfg, (3, 4, 3), cuda_devices=0) == torch.device("cpu")


@pytest.mark.parametrize("extra", [["train.recompute=selective"], ["train.recompute=full"], ["train.compile=true"],
                                   ["train.precision=fp16-mixed"], ["train.precision=bf16-pure"],
                                   ["train.precision=fp8"], ["finetune.lora_rank=4"], ["parallel.tp=2"]])
def test_launch_accepts_what_the_cp_compose_dist_tests_train(extra):
    from lmforge.parallel.world import check_launch  # tests/test_cp_compose_dist.py trains each of these
    world = 4 if "parallel.tp=2" in extra else 2
    assert check_launch(make_config("tiny", overrides=[*CP, *extra]), (0, world, 0), cuda_devices=0) == torch.device("cpu")


def test_dp_cp_groups_hold_the_ranks_of_one_tp_index():
    from lmforge.parallel.mesh import dp_cp_ranks
    # rank = (dp_index * cp + cp_index) * tp + tp_index: 8 ranks, dp = cp = tp = 2
    assert dp_cp_ranks(2, 2, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_cp_ranks(2, 2, 1) == [[0, 1, 2, 3]]
