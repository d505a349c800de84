"""Run by tests/test_tp_refusals_dist.py under torchrun (not a test module itself): the settings
tensor parallelism used to refuse (issue 23 part 5), each cell on parallel.tp=2 (2 ranks), every
rank's result gathered (gather_runs.py). A cell's kind is its name's first word:

    train    tp_compose_worker's cell: STEPS steps, losses, norms, gathered gradients, final state
             (split tensors gathered, whole ones, the norms' gains, as this rank holds them)
    bytes    tp_accounting_worker's measurement: the bytes saved for backward, states, traffic
    masks    the first block's attention core (a TensorRankRng: parallel/tp_rng.py) and the bare
             core inside it, on the same q, k, v on every rank from the same generator state
    mean     K forward losses in training mode (K dropout draws) of a model fitted to one batch,
             tensor-parallel and in one process, and the loss without dropout (eval mode)
"""

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gather_runs import gather_runs  # noqa: E402
from parallel_worker import global_batches  # noqa: E402
from tp_accounting_worker import measure  # noqa: E402
from tp_compose_worker import TP, run_cell  # noqa: E402
from tp_worker import tp_config  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

DRAWS, FIT_STEPS, ROWS = 32, 40, 4  # the mean cell: dropout draws, steps fitting the batch, its rows


def masks_cell(overrides: list[str]) -> dict:
    cfg = tp_config(TP, dist.get_world_size(), overrides)
    torch.manual_seed(cfg.train.seed)
    model = build_engine(cfg, get_policy(cfg.train.precision)).model
    core = model.blocks["0"].attn.core
    g = torch.Generator().manual_seed(5)
    heads = cfg.model.n_heads // TP
    q, k, v = (torch.randn(2, heads, 16, cfg.model.head_dim, generator=g) for _ in range(3))
    out = {}
    for name, module in (("wrapped", core), ("bare", core.module)):
        torch.manual_seed(11)
        first = module(q, k, v)
        after = torch.random.get_rng_state()
        torch.manual_seed(11)
        out[name] = dict(first=first, again=module(q, k, v), rng_after=after)
    out["no_dropout"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out["kind"] = type(core).__name__
    return out


def fitted_state(cfg, x, y) -> dict:
    """One process, no dropout, FIT_STEPS Adam steps on (x, y): a model whose loss dropout raises
    (at initialisation the loss is flat, and dropout's draws only spread it)."""
    torch.manual_seed(cfg.train.seed)
    model = Transformer(make_config("tiny", overrides=["model.dropout=0"]).model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(FIT_STEPS):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return model.state_dict()


@torch.no_grad()
def draws(model, x, y) -> dict:
    model.eval()
    plain = model(x, y).item()
    model.train()
    torch.manual_seed(3)
    return dict(plain=plain, draws=torch.stack([model(x, y) for _ in range(DRAWS)]))


def mean_cell(overrides: list[str]) -> dict:
    cfg = tp_config(TP, dist.get_world_size(), overrides)
    x, y = global_batches(0, 1, ROWS, cfg.model.vocab_size)[0]
    state = fitted_state(cfg, x, y)
    engine = build_engine(cfg, get_policy(cfg.train.precision))
    engine.load_model_state_dict({k: v.clone() for k, v in state.items()})
    one = Transformer(make_config("tiny", overrides=[o for o in overrides if not o.startswith("parallel.")]).model)
    one.load_state_dict(state)
    return dict(tp=draws(engine.model, x, y), one=draws(one, x, y))


KINDS = {"train": run_cell, "bytes": lambda overrides: measure([f"parallel.tp={TP}", *overrides]),
         "masks": masks_cell, "mean": mean_cell}

if __name__ == "__main__":
    gather_runs(lambda name, overrides: KINDS[name.split()[0]](overrides))
