"""Run by tests/test_cp_train_dist.py under torchrun (not a test module itself): train/setup.py's
engine with parallel.cp=2 (dp = world / 2 replicas, train.parallel=ddp) trains STEPS steps on
parallel_worker's global batches, each replica on its rows (both cp ranks of a replica on the
same rows: the model's pre-hook cuts their shards); every rank also trains one process on the
whole global batch from the same seed, and rank 0 saves both (losses, gradient norms, final state
by name) and the CP state loaded back into a fresh CP engine. argv: OUT, a JSON dict of cases
(name -> config overrides), e.g. {"plain": [], "sft29": ["+sft", "seq=29"]}: `+sft` gives rows
prompts without targets (so the cp shards of a row hold different target counts), `seq=N` cuts
the rows to N tokens (29: not a multiple of 2 cp, padded)."""

import datetime
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from parallel_worker import ROWS, global_batches  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.parallel.cp_model import RingAttentionCore  # noqa: E402
from lmforge.precision.policy import LossScaler  # noqa: E402
from lmforge.train.loop import train_step  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

STEPS, ACCUM, CP = 3, 2, 2


def train(engine, cfg, global_rows: int, mine: slice, prompts: bool, seq: int, held: dict | None = None):
    """STEPS steps on global micro-batches of `global_rows` rows, this rank on rows `mine`; `held`
    gets the engine's state_bytes with the last step's gradients still there."""
    policy, losses, norms = get_policy(cfg.train.precision), [], []
    scaler = LossScaler(enabled=policy.loss_scaling)
    for step in range(STEPS):
        if held is not None and step == STEPS - 1:
            zero_grad = engine.zero_grad
            engine.zero_grad = lambda: (held.update(engine.state_bytes()), zero_grad())
        batches = iter([(x[mine, :seq], y[mine, :seq])
                        for x, y in global_batches(step, ACCUM, global_rows, cfg.model.vocab_size, prompts)])
        loss, norm, _ = train_step(engine, lambda: next(batches), ACCUM, cfg.optim.lr, cfg.optim.grad_clip,
                                   scaler, policy, torch.device("cpu"))
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def floats(state: dict) -> dict:
    """A state by name in fp32 (16-bit policies compare as numbers; fp32 ones are unchanged)."""
    return {k: v.float() for k, v in state.items()}


def run_case(overrides: list[str]) -> dict:
    prompts = "+sft" in overrides
    seq = next((int(o[4:]) for o in overrides if o.startswith("seq=")), 32)
    extra = [o for o in overrides if o != "+sft" and not o.startswith("seq=")]
    common = ["train.sample_tokens=0", f"train.grad_accum={ACCUM}", "optim.lr=3e-3", *extra]
    cfg = make_config("tiny", overrides=[f"parallel.cp={CP}", "train.parallel=ddp", *common])
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    initial = {k: v.float().clone() for k, v in engine.model_state_dict().items()}
    global_rows, r = engine.replicas * ROWS, engine.replica
    held = {}
    losses, norms = train(engine, cfg, global_rows, slice(r * ROWS, (r + 1) * ROWS), prompts, seq, held)
    state = engine.model_state_dict()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])  # where compile stopped tracing (train.compile)
    torch.manual_seed(cfg.train.seed + 1)  # another initialisation: the load must replace it all
    fresh = build_engine(cfg, get_policy(cfg.train.precision))
    fresh.load_model_state_dict({k: v.clone() for k, v in state.items()})

    one_cfg = make_config("tiny", overrides=[o for o in common if not o.startswith("parallel.")])  # one process
    torch.manual_seed(one_cfg.train.seed)
    one = build_engine(one_cfg, get_policy(one_cfg.train.precision))
    ref_losses, ref_norms = train(one, one_cfg, global_rows, slice(None), prompts, seq)
    traffic = next(m.traffic for m in engine.model.modules() if isinstance(m, RingAttentionCore))
    return dict(losses=losses, norms=norms, model=floats(state), reloaded=floats(fresh.model_state_dict()),
                ref=dict(losses=ref_losses, norms=ref_norms, model=floats(one.model_state_dict())),
                initial=initial, graph_breaks=breaks, held=held, precision=cfg.train.precision,
                steps=STEPS * ACCUM, seq=seq,
                traffic={**traffic.bytes, **{f"sends_{k}": n for k, n in traffic.sends.items()}},
                replica=engine.replica, replicas=engine.replicas, cp_rank=engine.model.loss.collectives.rank)


def main(out: str, cases: dict) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {name: run_case(overrides) for name, overrides in cases.items()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if dist.get_rank() == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
