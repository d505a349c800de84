"""The plan's count of Muon's gather under tensor parallelism (accounting/comm.py's part
"optimizer" of tensor_parallel_communication), without processes: tests/test_muon_tp_dist.py
measures it equal on real ranks."""

from lmforge.accounting.comm import tensor_parallel_communication
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.modes import POLICIES


def test_muon_gathers_each_split_block_matrix_once_a_step():
    cfg = make_config("tiny").model  # 2 KV heads
    named = dict(Transformer(cfg).named_parameters())
    blocks = sum(p.numel() for name, p in named.items() if name.startswith("blocks.") and p.ndim == 2)
    kv = sum(p.numel() for name, p in named.items() if name.endswith(("k_proj.weight", "v_proj.weight")))
    fp32, bf16 = POLICIES["fp32"], POLICIES["bf16-pure"]

    def part(tp, **kw):
        return tensor_parallel_communication(cfg, 4, 64, tp, False, **kw)["ring_bytes"].get("optimizer")
    assert part(2) is None  # AdamW: element-wise, nothing gathered
    assert part(2, optimizer="muon") == 4 * blocks
    # once a step: the accumulation micro-batches do not repeat it
    assert part(2, optimizer="muon", grad_accum=3) == 4 * blocks
    # tp=4 over 2 KV heads: each k and v slice is held by 2 ranks, and the gather moves both copies
    assert part(4, optimizer="muon", policy=fp32) == 4 * (blocks + kv)
    assert part(2, optimizer="muon", policy=bf16) == 2 * blocks  # the gradient's dtype
    assert part(2, optimizer="muon", lora=(4, "q_proj,v_proj")) is None  # the adapters are AdamW's
    with_gather = tensor_parallel_communication(cfg, 4, 64, 2, True, optimizer="muon")
    assert with_gather["sent_bytes"] == tensor_parallel_communication(cfg, 4, 64, 2, True)["sent_bytes"] + 2 * blocks
