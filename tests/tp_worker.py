"""Run by tests/test_tp_dist.py under torchrun (not a test module itself): the tensor-parallel model
(lmforge/parallel/tp.py) on the ranks of one launch; rank 0 saves what the test compares.

    train     parallel.tp=TP (world / TP replicas under ddp): STEPS steps of parallel_worker's global
              batches, each replica on its rows; the losses, gradient norms, the last step's
              gradients gathered by name, the final state (full tensors), and that state loaded
              back into a fresh tp engine
    ce        vocab_parallel_cross_entropy on split random logits: its loss and gathered gradient
    dtensor   PyTorch's own TP (parallelize_module, ColwiseParallel / RowwiseParallel, loss_parallel)
              on the same model and batch: loss and gathered gradients, beside ours
"""

import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from parallel_worker import ROWS, SEQ, global_batches, train  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.model.transformer import IGNORE_INDEX, Transformer  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.parallel.comm import Collectives  # noqa: E402
from lmforge.parallel.mesh import build_groups  # noqa: E402
from lmforge.parallel.tp import shard_copies, sharded_dim  # noqa: E402
from lmforge.parallel.tp_engine import gather_full  # noqa: E402
from lmforge.parallel.tp_ops import vocab_parallel_cross_entropy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

STEPS, ACCUM = 3, 2


def tp_config(tp: int, world: int, extra=()):
    return make_config("tiny", overrides=[f"parallel.tp={tp}", "train.sample_tokens=0",
                                          f"train.parallel={'ddp' if world > tp else 'none'}",
                                          f"train.grad_accum={ACCUM}", *extra])


def gathered_grads(model, tp_comm) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() if sharded_dim(p) is None else gather_full(p.grad, sharded_dim(p), tp_comm,
                                                                                     shard_copies(p))
            for name, p in model.named_parameters()}


def run_train(tp: int, extra: list[str]) -> dict:
    world = dist.get_world_size()
    cfg = tp_config(tp, world, extra)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    held = {}
    losses, norms = train(engine, cfg, STEPS, engine.replica, engine.replicas,
                          on_grads=lambda e: held.update(grads=gathered_grads(e.model, e.tp_comm),
                                                         local_bytes=e.state_bytes()["parameters"]))
    model_state, optimizer_state = engine.model_state_dict(), engine.optimizer_state_dict()
    torch.manual_seed(cfg.train.seed + 1)  # another initialisation: the load must replace it all
    fresh = build_engine(cfg, get_policy(cfg.train.precision))
    fresh.load_model_state_dict({k: v.clone() for k, v in model_state.items()})
    fresh.load_optimizer_state_dict(optimizer_state)
    return dict(losses=losses, norms=norms, model=model_state, optimizer=optimizer_state, num_params=engine.num_params(),
                reloaded=(fresh.model_state_dict(), fresh.optimizer_state_dict()), **held)


def run_ce(tp_comm: Collectives) -> dict:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, 16, (3, 5), generator=g)
    targets[0, :2] = IGNORE_INDEX
    local = logits.chunk(tp_comm.world, dim=-1)[tp_comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, tp_comm, vocab_start=tp_comm.rank * local.shape[-1])
    loss.backward()
    return dict(logits=logits, targets=targets, loss=loss.detach(), grad=gather_full(local.grad, 2, tp_comm))


def run_dtensor(tp: int) -> dict:
    """PyTorch's TP on a model of untied embeddings (DTensor's plans shard one module at a time)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    cfg = tp_config(tp, tp, ["model.tie_embeddings=false", "train.grad_accum=1"])
    x, y = global_batches(0, 1, ROWS, cfg.model.vocab_size)[0]
    torch.manual_seed(cfg.train.seed)
    ours = build_engine(cfg, get_policy("fp32"))
    ours.model(x, y).backward()
    our_grads = gathered_grads(ours.model, ours.tp_comm)
    our_loss = ours.model(x, y).detach()

    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model)
    mesh = build_groups(tp).mesh["tp"]
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for layer in model.blocks:
        prefix = f"blocks.{layer}"
        plan.update({f"{prefix}.attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{prefix}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan.update({f"{prefix}.attn.o_proj": RowwiseParallel(), f"{prefix}.mlp.down_proj": RowwiseParallel()})
        attn = model.blocks[layer].attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    parallelize_module(model, mesh, plan)
    with loss_parallel():
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
    torch_grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                   for name, p in model.named_parameters()}
    return dict(ours=(our_loss, our_grads), torch=(loss.detach().full_tensor(), torch_grads))


def main(out: str, tp: int, parts: str, extra: list[str]):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for part in parts.split(","):
        if part == "train":
            results[part] = run_train(tp, extra)
        elif part == "ce":
            results[part] = run_ce(Collectives(build_groups(tp).mesh["tp"].get_group()))
        elif part == "dtensor":
            results[part] = run_dtensor(tp)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert SEQ <= 64  # the tiny model's max_seq_len
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
