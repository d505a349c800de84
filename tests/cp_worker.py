"""Run by tests/test_cp_dist.py under torchrun (not a test module itself): every rank of a gloo group
(the CP group is the whole world) runs ring attention and a whole model under apply_context_parallel,
computes the one-process reference itself on the same seeds, and rank 0 saves every rank's
measurements (a list by rank) to OUT: the largest differences, and the ring bytes counted beside
those predicted. Launched by tests/test_pipeline.py's run_worker (argv: OUT, then a JSON dict,
unused: every case runs)."""

import copy
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.accounting.comm import step_communication
from lmforge.accounting.cp import context_parallel_bytes, ring_attention_bytes
from lmforge.config import make_config
from lmforge.model.attention import naive_attention
from lmforge.model.transformer import Transformer
from lmforge.parallel.cp import RingTraffic, ring_attention, zigzag_split
from lmforge.parallel.cp_model import apply_context_parallel

# (batch, heads, kv_heads, seq, d_head): multi-head and grouped-query attention
ATTENTION_CASES = [(2, 4, 4, 32, 8), (1, 6, 2, 48, 16)]
# (name, preset overrides, seq): llama (RoPE, GQA) at a multiple of 2 cp and not; gpt (learned
# positions, biases) at its whole max_seq_len of 30, which pads past the position table
MODEL_CASES = [("llama_32", [], 32), ("llama_29", [], 29),
               ("gpt_30", ["model.family=gpt", "model.max_seq_len=30", "model.n_kv_heads=4"], 30)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def attention_case(batch, heads, kv_heads, seq, d_head, group, dtype=torch.float32) -> dict:
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = (torch.randn(batch, h, seq, d_head, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    reference = naive_attention(q, k, v, causal=True)
    grad_out = torch.randn_like(reference)
    reference.backward(grad_out)
    local = [zigzag_split(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    traffic = RingTraffic()
    out = ring_attention(*local, group, traffic)
    out.backward(zigzag_split(grad_out, cp, rank, dim=2))
    errors = {"out": max_diff(out, zigzag_split(reference, cp, rank, dim=2))}
    for name, mine, full in zip(("dq", "dk", "dv"), local, (q, k, v)):
        errors[name] = max_diff(mine.grad, zigzag_split(full.grad, cp, rank, dim=2))
    predicted = ring_attention_bytes(batch, kv_heads, seq // cp, d_head, cp, element_bytes=dtype.itemsize)
    return {"errors": errors, "measured": {**traffic.bytes, **{f"sends_{k}": n for k, n in traffic.sends.items()}},
            "predicted": predicted}


def all_reduce_gradients(cp_state, model) -> None:
    """Average each gradient over the CP group: the ranks' losses average to the whole loss."""
    for p in model.parameters():
        if p.grad is not None:
            cp_state.collectives.all_reduce(p.grad)
            p.grad.div_(cp_state.cp)


def global_loss(cp_state, loss: torch.Tensor) -> float:
    """The batch's mean loss (the ranks' losses averaged), for reporting."""
    total = loss.detach().clone()
    cp_state.collectives.all_reduce(total, kind="scalar")
    return total.item() / cp_state.cp


def model_case(overrides, seq, group) -> dict:
    cp = dist.get_world_size(group)
    cfg = make_config("tiny", overrides=["model.dropout=0", *overrides]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_loss = reference(inputs, targets)
    ref_loss.backward()

    cp_state = apply_context_parallel(model, group)
    loss = model(*cp_state.shard(inputs, targets))
    loss.backward()
    all_reduce_gradients(cp_state, model)
    ref_grads = dict(reference.named_parameters())
    grad_errors = {name: max_diff(p.grad, ref_grads[name].grad) for name, p in model.named_parameters()}
    return {"loss": global_loss(cp_state, loss), "ref_loss": ref_loss.item(),
            "grad_error": max(grad_errors.values()), "worst": max(grad_errors, key=grad_errors.get),
            "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters()),
            "measured": {**cp_state.traffic.bytes, **{f"sends_{k}": n for k, n in cp_state.traffic.sends.items()}},
            "predicted": context_parallel_bytes(cfg, 2, seq, cp, element_bytes=4),
            # the gradient all-reduce over the CP group moves what DDP's over as many ranks does
            "grad_bytes": cp_state.collectives.sent_bytes("model"),
            "grad_bytes_predicted": step_communication(cfg, "ddp", cp)["sent_bytes"]}


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    results = {"attention": [attention_case(*case, group) for case in ATTENTION_CASES],
               # bf16 K/V messages (fp32 dK/dV accumulators): its bytes, against the formula
               "attention_bf16": attention_case(*ATTENTION_CASES[1], group, dtype=torch.bfloat16),
               "model": {name: model_case(overrides, seq, group) for name, overrides, seq in MODEL_CASES}}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if dist.get_rank() == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
