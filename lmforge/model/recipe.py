"""Modules of the speedrun recipe (docs/recipe.md) that model/transformer.py builds when a config asks:
the ReLU^2 MLP (model.mlp=relu2) and the soft-capped LM head (model.logit_softcap). Each is picked when
the model is built; no forward pass asks whether it is on.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.config import ModelConfig


class ReLU2MLP(nn.Module):
    """FFN(x) = ReLU(x W_up)^2 W_down, width 4d, no biases (Primer, So et al. 2021, section 3; modded-nanogpt)."""
    ACTIVATION_INPUT = "up_proj"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class SoftcapHead(nn.Linear):
    """The LM head with logit soft-capping, cap * tanh(x W^T / cap) (Gemma 2, Team et al. 2024; modded-nanogpt):
    logits stay in (-cap, cap), nearly unchanged while |logit| << cap. Built for model.logit_softcap;
    its weight is named, tied and stored as the plain head's (wrap.py reads `cap`)."""

    def __init__(self, d_model: int, vocab_size: int, cap: float):
        super().__init__(d_model, vocab_size, bias=False)
        self.cap = cap

    def forward(self, x):
        return softcap(super().forward(x), self.cap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cap={self.cap:g}"


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c tanh(z / c), each logit alone (`cap` None: the logits as they are)."""
    return logits if cap is None else cap * torch.tanh(logits / cap)
