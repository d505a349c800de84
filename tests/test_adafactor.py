"""Adafactor (optim/adafactor.py) against torch.optim.Adafactor, and its state bytes against the plan's."""

import pytest
import torch

from lmforge.accounting.measure import model_state_bytes_measured
from lmforge.accounting.memory import optimizer_state_bytes
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.modes import get_policy
from lmforge.optim.adafactor import Adafactor

# a matrix, a batch of matrices (factored over the last two dims) and a vector (unfactored)
SHAPES = [(48, 16), (3, 8, 12), (24,)]


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in SHAPES]


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1, "lr": 3e-3, "d": 2.0}])
def test_200_steps_are_torchs_adafactor_bit_for_bit(options):
    """torch's defaults (lr 1e-2 as the relative-step cap, decay -0.8, eps (None, 1e-3), d = 1), and
    a second setting with decay, a smaller cap and a looser clip. The same operations in the same
    order, in fp32 on the CPU: equal without tolerance. Gradients are noise plus 0.5 x the
    parameters (a weight penalty's), scaled up at some steps so that update clipping engages."""
    ours, theirs = parameters(), parameters()
    mine, reference = Adafactor(ours, **options), torch.optim.Adafactor(theirs, **options)
    for step in range(200):
        generator = torch.Generator().manual_seed(1000 + step)
        scale = 30.0 if step % 17 == 0 else 1.0
        for p, q in zip(ours, theirs):
            g = scale * torch.randn(p.shape, generator=generator) + 0.5 * p.detach()
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert mine.state[p].keys() == reference.state[q].keys()
        for key in mine.state[p]:
            assert torch.equal(mine.state[p][key], reference.state[q][key]), key
    assert not torch.equal(ours[0], parameters()[0])


def test_measured_state_bytes_are_the_plans():
    """accounting/memory.py costs Adafactor's state as n + m row and column averages per matrix
    (its `row_var` (n, 1) over the last dim and `col_var` (1, m)) and a full second moment per
    vector: the live optimizer's state tensors on the tiny model hold exactly those bytes."""
    cfg = make_config("tiny").model
    model = Transformer(cfg)
    optimizer = Adafactor(model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    embedding = optimizer.state[model.tok_embeddings.weight]
    assert embedding["row_var"].shape == (cfg.vocab_size, 1) and embedding["col_var"].shape == (1, cfg.d_model)
    measured = model_state_bytes_measured(model, optimizer)["optimizer_states"]
    assert measured == optimizer_state_bytes(cfg, "adafactor", get_policy("fp32"))
