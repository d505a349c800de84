"""Autoregressive generation: temperature, top-k and nucleus (top-p) sampling, with a KV cache.

Without a cache, every new token runs the model over the whole context: O(T^2) work for T tokens.
The cache keeps each layer's keys and values for the positions already seen, so each step feeds
only the newest token (attention to the cached positions is unchanged, because keys and values of
earlier positions do not depend on later tokens in a causal model).

When the context fills the model's max_seq_len, both paths restart from the most recent
max_seq_len // 2 tokens, so cached and uncached generation always see the same context.
"""

from collections.abc import Collection

import torch

from lmforge.model.transformer import Transformer


class KVCache:
    """Keys and values of every layer for positions [0, length), preallocated to max_len; they are
    those of tokens[start:start + length] of the sequence generated (a chat keeps one across turns)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.start, self.length = 0, 0

    def layer(self, index: int) -> "LayerCache":
        """The cache of one layer, handed to that layer's attention alone."""
        return LayerCache(self.keys[index], self.values[index])


class LayerCache:
    """One layer's slice of a KVCache: (batch, kv_heads, max_len, head_dim) keys and values."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        """Store k, v (batch, kv_heads, new, head_dim) at start_pos; return all keys/values so far."""
        end = start_pos + k.shape[2]
        self.keys[:, :, start_pos:end] = k
        self.values[:, :, start_pos:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` (batch, vocab). temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Holtzman et al. 2020: keep the smallest set of tokens whose probability mass reaches top_p.
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_token: int | Collection[int] | None = None,
             seed: int = 0, use_cache: bool = True, on_logits=None, constraint=None, cache: KVCache | None = None,
             on_token=None) -> list[int]:
    """New token ids continuing `prompt` (a stop token, one id or any of several, if sampled, ends
    generation and is not returned). `on_logits`, if given, is called with each step's next-token
    logits, `on_token` with each new token (streaming). `cache`, if given, is used and left holding
    the sequence (its start and length say which part): a later call whose prompt begins with that
    part runs only the rest through the model.

    `constraint`, if given, restricts which tokens may come next (grammar-constrained decoding,
    lmforge/structured/constrain.py): before each step `constraint.finished()` may end generation,
    `constraint.allowed(vocab_size)` gives a boolean mask over the vocabulary that is applied to the
    logits before temperature, top-k and top-p, and `constraint.consume(token)` is told each token
    chosen (the stop token included). The mask concerns only the tokens generated, so it works
    unchanged with the KV cache and its context restarts."""
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    model.eval()
    cfg = model.cfg
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    max_len = cfg.max_seq_len
    tokens = list(prompt)
    stops = {stop_token} if isinstance(stop_token, int) else set(stop_token or ())
    if use_cache and cache is None:
        cache = KVCache(cfg.n_layers, 1, cfg.kv_heads, max_len, cfg.head_dim, dtype, device)
    if cache is not None and cache.length:
        start, cached = cache.start, cache.length  # the caller's cache holds tokens[start:start + cached]
    else:
        start = max(0, len(tokens) - max_len)  # first position of the current context window
        cached = 0  # positions of the window already in the cache
    new_tokens: list[int] = []
    for _ in range(max_new_tokens):
        if constraint is not None and constraint.finished():
            break
        if len(tokens) - start > max_len:
            start, cached = len(tokens) - max_len // 2, 0
        if use_cache:
            feed = torch.tensor([tokens[start + cached:]], device=device)
            logits = model(feed, kv_cache=cache, start_pos=cached)[:, -1]
            cached = len(tokens) - start
        else:
            logits = model(torch.tensor([tokens[start:]], device=device))[:, -1]
        if on_logits is not None:
            on_logits(logits)
        if constraint is not None:
            allowed = constraint.allowed(logits.shape[-1]).to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(sample_next(logits, temperature, top_k, top_p, generator))
        if constraint is not None:
            constraint.consume(token)
        if token in stops:
            break
        tokens.append(token)
        new_tokens.append(token)
        if on_token is not None:
            on_token(token)
    if cache is not None:
        cache.start, cache.length = start, cached
    return new_tokens
