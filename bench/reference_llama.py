"""The default lmforge model written the plain way: torch.nn layers, SDPA, torch.optim.AdamW.

This is the yardstick of bench/throughput.py. It has the same shapes and the same FLOPs as
lmforge's `small` preset (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied embeddings), but
uses PyTorch's own modules wherever PyTorch has one, and nothing from lmforge.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, d, heads, kv_heads, ff, eps):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ReferenceLlama(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, ff, max_len, theta=10000.0, eps=1e-5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        self.layers = nn.ModuleList(Layer(d, heads, kv_heads, ff, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=eps)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        hd = d // heads
        freqs = torch.outer(torch.arange(max_len).float(), theta ** (-torch.arange(0, hd, 2).float() / hd))
        freqs = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
