"""Rotary position embeddings (Su et al. 2021, "RoFormer"): the frequencies (with Llama 3.1's
long-context scaling), the cos/sin tables and the rotation applied to queries and keys.
model/transformer.py's attention calls `apply_rope` with a `RotaryTables` module's slices."""

import math

import torch
import torch.nn as nn

from lmforge.config import ModelConfig


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequencies theta_i = theta^(-2(i-1)/d), i = 1..d/2 (Su et al. 2021, eq. 15), in float64.

    With `scaling` of rope_type llama3 (Llama 3.1, Dubey et al. 2024; Meta's released reference code),
    a model trained on `original_max_position_embeddings` positions reads contexts `factor` times
    longer: frequencies whose wavelength 2 pi / theta_i is shorter than original / high_freq_factor
    (they turn many times within the old context) are kept; those longer than original /
    low_freq_factor are divided by `factor`; in between, the two are blended linearly in
    original / wavelength, so the spectrum has no jump.
    """
    # on the CPU, whatever the default device: a few MB of float64 at most, and on the meta device (a
    # model built for its shapes) these ops would load torch._dynamo, seconds for nothing
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freqs
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
    scaled = (1 - blend) * freqs / factor + blend * freqs
    scaled = torch.where(wavelength < original / high, freqs, scaled)
    return torch.where(wavelength > original / low, freqs / factor, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles m * theta_i, each of shape (max_seq_len, head_dim).

    The angles are laid out as [angles, angles] for the rotate-half form below (the layout of
    GPT-NeoX and of Hugging Face Llama checkpoints), which pairs dimension j with dimension j + d/2.
    """
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_j, x_{j+d/2}) of x (batch, heads, seq, head_dim) by its angle (eq. 34)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class RotaryTables(nn.Module):
    """The cos/sin tables of rotary embeddings, computed once (fp32 buffers, not parameters: a
    precision policy that casts parameters leaves them alone). Every pipeline stage keeps one."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        device = torch.get_default_device()
        if device.type == "meta":  # a shapes-only build (accounting/shapes.py): no values to compute on the CPU
            cos = sin = torch.empty(cfg.max_seq_len, cfg.head_dim)
        else:
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, start_pos: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = slice(start_pos, start_pos + seq_len)
        return self.cos[window], self.sin[window]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at each row's own positions (batch, seq): (batch, 1, seq, head_dim), for a padded batch."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
