"""Run by tests/test_parallel_engines.py under torchrun (not a test module itself): trains the
`tiny` model a few steps under each strategy given, every rank on its rows of one global batch,
and rank 0 saves what the test compares (full state by name, losses, bytes held, bytes sent).
A strategy's key is `name@precision`, optionally followed by variants (`+lora`, `+torch_adamw`,
`+sft`, `+compile`, `+recompute_full`, ...: VARIANTS), e.g. `zero3@fp32+lora`. `+sft` is a full
fine-tune: the model starts from a base's weights (BASE_SEED's initialisation, not the run's) and
each row's first tokens are a prompt, without targets (IGNORE_INDEX), of a length that differs by
row and micro-batch, so ranks and micro-batches hold different numbers of targets."""

import copy
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from lmforge.config import make_config
from lmforge.model.transformer import IGNORE_INDEX, Transformer
from lmforge.parallel.engine import Engine
from lmforge.parallel.parallelize import parallelize
from lmforge.precision.policy import LossScaler
from lmforge.modes import get_policy
from lmforge.train.loop import train_step
from lmforge.optim.build import weight_decay_groups
from lmforge.train.setup import build_engine, build_model, build_optimizer

SEQ, ROWS = 32, 2  # tokens per row; rows per rank per micro-batch
VARIANTS = {"lora": ["finetune.lora_rank=4"],  # config overrides of each variant
            "torch_adamw": [],  # the engine built around torch.optim.AdamW instead of lmforge's
            "sft": ["finetune.base=base"],  # a full fine-tune (see the docstring)
            "compile": ["train.compile=true"],
            "recompute_full": ["train.recompute=full"],
            "recompute_selective": ["train.recompute=selective"],
            "muon": ["optim.name=muon"],  # Muon for the block matrices (optim/muon.py): tests/test_muon_dist.py
            "adafactor": ["optim.name=adafactor"],  # optim/adafactor.py, ddp only (launch.py): the same test
            "reload": []}  # every strategy's state loaded back into a fresh engine (not only RELOADED's)
BASE_SEED = 4321
RELOADED = ("zero1", "zero3", "ddp")


def config(strategy: str, precision: str, grad_accum: int, extra=()):
    return make_config("tiny", overrides=[f"train.parallel={strategy}", f"train.precision={precision}",
                                          f"train.grad_accum={grad_accum}", *extra])


def parse_key(key: str) -> tuple[str, str, list[str]]:
    """"zero3@fp32+lora" -> ("zero3", "fp32", ["lora"])."""
    strategy, rest = key.split("@")
    precision, *variants = rest.split("+")
    return strategy, precision, variants


def variant_config(strategy: str, precision: str, grad_accum: int, variants: list[str]):
    return config(strategy, precision, grad_accum, [o for v in variants for o in VARIANTS[v]])


def make_engine(cfg, variants: list[str]) -> Engine:
    """train/setup.py's engine of `cfg`; with torch_adamw, the same around torch.optim.AdamW."""
    policy = get_policy(cfg.train.precision)
    if "torch_adamw" not in variants:
        return build_engine(cfg, policy, base_state=base_weights(cfg) if cfg.finetune.base else None)
    o = cfg.optim
    return parallelize(build_model(cfg, policy), cfg, policy,
                       make_optimizer=lambda groups: torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2),
                                                                      eps=o.eps),
                       weight_decay_groups=lambda model: weight_decay_groups(model, o.weight_decay))


def base_weights(cfg) -> dict[str, torch.Tensor]:
    """A fine-tuning base: the model initialised from BASE_SEED (the run's seed is left as it was)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(BASE_SEED)
    weights = Transformer(cfg.model).state_dict()
    torch.random.set_rng_state(state)
    return weights


def global_batches(step: int, grad_accum: int, rows: int, vocab: int, prompts: bool = False):
    """The step's micro-batches of `rows` rows (the same on every rank); with `prompts`, row i of
    micro-batch m has no targets for its first 1 + (5 i + 3 m + step) % (SEQ - 2) positions."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (grad_accum, rows, SEQ + 1), generator=g)
    batches = [(t[:, :-1], t[:, 1:].clone()) for t in tokens]
    for m, (_, y) in enumerate(batches if prompts else ()):
        for i in range(rows):
            y[i, :1 + (5 * i + 3 * m + step) % (SEQ - 2)] = IGNORE_INDEX
    return batches


def train(engine, cfg, steps: int, rank: int, ranks: int, rows: int = ROWS, on_grads=None):
    """`steps` optimizer steps on global batches of ranks * rows rows; rank r takes rows
    r*rows:(r+1)*rows of each micro-batch (one process: ranks=1, rows = the whole batch)."""
    policy = get_policy(cfg.train.precision)
    scaler = LossScaler(enabled=policy.loss_scaling)
    losses, norms = [], []
    for step in range(steps):
        batches = iter([(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
                        for x, y in global_batches(step, cfg.train.grad_accum, ranks * rows, cfg.model.vocab_size,
                                                   prompts=cfg.finetune.base is not None)])
        if step == steps - 1 and engine.comm is not None:
            engine.comm.reset()  # count one step's traffic
        if on_grads is not None and step == steps - 1:
            zero_grad = engine.zero_grad
            engine.zero_grad = lambda: (on_grads(engine), zero_grad())
        loss, norm, _ = train_step(engine, lambda: next(batches), cfg.train.grad_accum, cfg.optim.lr,
                                   cfg.optim.grad_clip, scaler, policy, torch.device("cpu"))
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


class TorchDDP(Engine):
    """torch.nn.parallel.DistributedDataParallel behind the engine interface: the reference."""

    def __init__(self, cfg):
        policy = get_policy(cfg.train.precision)
        model = build_model(cfg, policy)
        super().__init__(nn.parallel.DistributedDataParallel(model), build_optimizer(cfg, policy, model))
        self.inner = model

    def no_sync(self):
        return self.model.no_sync()

    def model_state_dict(self):
        return self.inner.state_dict()

    def mean_across_ranks(self, value):
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / dist.get_world_size()


def main(out: str, strategies: str, grad_accum: int, steps: int):
    """strategies: comma-separated keys (parse_key; torch_ddp: DistributedDataParallel)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for key in strategies.split(","):
        strategy, precision, variants = parse_key(key)
        cfg = variant_config(strategy if strategy != "torch_ddp" else "ddp", precision, grad_accum, variants)
        torch.manual_seed(cfg.train.seed)
        engine = TorchDDP(cfg) if strategy == "torch_ddp" else make_engine(cfg, variants)
        held = {}
        losses, norms = train(engine, cfg, steps, rank, ranks,
                              on_grads=lambda e: held.update(e.state_bytes(), sent=e.comm.sent_bytes("model")
                                                             if e.comm else None,
                                                             ring=dict(e.comm.ring_bytes) if e.comm else None,
                                                             calls=dict(e.comm.calls) if e.comm else None))
        if engine.comm is not None:
            engine.comm.reset()
        model_state = engine.model_state_dict()
        optimizer_state = engine.optimizer_state_dict() if strategy != "torch_ddp" else None
        # a fresh engine loads the state back: each rank keeps its shard of the same full tensors
        reloaded = None
        if (strategy in RELOADED or "reload" in variants) and "torch_adamw" not in variants:
            torch.manual_seed(cfg.train.seed + 1)
            fresh = build_engine(cfg, get_policy(precision))
            # copies: FSDP's loads turn the entries of the dicts they are given into DTensors
            fresh.load_model_state_dict({k: v.clone() for k, v in model_state.items()})
            fresh.load_optimizer_state_dict(copy.deepcopy(optimizer_state))
            reloaded = (fresh.model_state_dict(), fresh.optimizer_state_dict())
        results[key] = dict(model=model_state, optimizer=optimizer_state, losses=losses, norms=norms,
                                 held=held, reloaded=reloaded)
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
