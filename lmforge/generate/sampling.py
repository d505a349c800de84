"""Autoregressive generation: temperature, top-k and nucleus (top-p) sampling, with a KV cache.

Without a cache, every new token runs the model over the whole context: O(T^2) work for T tokens.
The cache keeps each layer's keys and values for the positions already seen, so each step feeds
only the newest token (attention to the cached positions is unchanged, because keys and values of
earlier positions do not depend on later tokens in a causal model).

When the context fills the model's max_seq_len, both paths restart from the most recent
max_seq_len // 2 tokens, so cached and uncached generation always see the same context.

The cache holds the positions a generation can reach, the prompt plus max_new_tokens (at most
max_seq_len), not the model's maximum: Llama 3.2's 131,072 positions would be 4 GiB of bf16 keys
and values before the first token for a 1B model. A longer generation (a chat that continues a
conversation in the same cache) grows it, at least doubling, so that growth copies O(T) in all.
It is kept in the dtype of the model's parameters (bf16 weights, a bf16 cache), with as many KV
heads as the model's attention layers hold: a tensor-parallel rank (parallel/tp.py) holds 1/tp of
them, so its cache is split by heads like its k_proj and v_proj, and every rank generates together.

generate_batch decodes many prompts in one batch (an evaluation's generation tasks; the rows'
layout is generate/batch.py's), each row stopping on its own; generate() is its batch of one, so
one loop serves `generate`, `chat` and `lmforge eval`.
"""

from collections.abc import Collection

import torch

from lmforge.generate.batch import Rows, decode_step
from lmforge.model.transformer import Attention, Transformer


class KVCache:
    """Keys and values of every layer for positions [0, length), allocated for `capacity`
    positions and grown (`reserve`) up to `limit`, the model's max_seq_len. After generate() they
    are those of tokens[start:start + length] of the sequence it made (a chat reuses them)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, limit: int | None = None):
        shape = (n_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.limit = capacity if limit is None else limit
        self.start, self.length = 0, 0

    @classmethod
    def for_model(cls, model: Transformer, positions: int, batch: int = 1) -> "KVCache":
        """A cache for `positions` positions (at most max_seq_len) of `model`, in its parameters' dtype,
        for the KV heads its attention layers hold (this rank's, under tensor parallelism)."""
        cfg, param = model.cfg, next(model.parameters())
        kv_heads = next(m.n_kv_heads for m in model.modules() if isinstance(m, Attention))
        return cls(cfg.n_layers, batch, kv_heads, min(positions, cfg.max_seq_len), cfg.head_dim, param.dtype,
                   param.device, limit=cfg.max_seq_len)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: 2 (K, V) x layers x batch x kv heads x capacity x head dim x dtype bytes."""
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, positions: int) -> None:
        """Room for `positions` positions: a larger cache (at least twice as large, at most `limit`)
        holding what this one held."""
        if positions <= self.capacity:
            return
        if positions > self.limit:
            raise ValueError(f"positions up to {positions} exceed the cache's limit of {self.limit}")
        grown = min(max(positions, 2 * self.capacity), self.limit)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], grown, old.shape[4]))
            new[:, :, :, :old.shape[3]] = old
            setattr(self, name, new)

    def rows(self, index: torch.Tensor) -> "KVCache":
        """A cache whose row i is a copy of this one's row index[i] (a context's row copied to
        each of its continuations; a batch without its finished rows)."""
        picked = KVCache.__new__(KVCache)
        picked.keys, picked.values = self.keys.index_select(1, index), self.values.index_select(1, index)
        picked.limit, picked.start, picked.length = self.limit, self.start, self.length
        return picked

    def row_from(self, row: int, column: int) -> "KVCache":
        """Row `row` of this cache from `column` on, as a cache of one row starting at 0: a view, so
        that filling it fills this one (a left-padded row of a batch, run alone: generate_batch)."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values = (t[:, row:row + 1, :, column:] for t in (self.keys, self.values))
        view.limit, view.start, view.length = view.capacity, 0, 0
        return view

    def layer(self, index: int) -> "LayerCache":
        """The cache of one layer, handed to that layer's attention alone."""
        return LayerCache(self.keys[index], self.values[index])


class LayerCache:
    """One layer's slice of a KVCache: (batch, kv_heads, capacity, head_dim) keys and values."""

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


def choose_next(logits: torch.Tensor, constraints: list, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator) -> list[int]:
    """The next token of each row of `logits`: sampled among those its constraint (if any) allows,
    which is told the choice. A constraint's mask of None allows every token."""
    masks = [c.allowed(logits.shape[-1]) if c is not None else None for c in constraints]
    if any(mask is not None for mask in masks):
        every = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        allowed = torch.stack([every if mask is None else mask.to(logits.device) for mask in masks])
        logits = logits.masked_fill(~allowed, float("-inf"))
    chosen = sample_next(logits, temperature, top_k, top_p, generator).tolist()
    for constraint, token in zip(constraints, chosen):
        if constraint is not None:
            constraint.consume(token)
    return chosen


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_token: int | Collection[int] | None = None,
             seed: int = 0, use_cache: bool = True, on_logits=None, constraint=None,
             cache: KVCache | None = None, cached: int = 0, on_token=None) -> list[int]:
    """New token ids continuing `prompt` (a stop token, one id or any of several, if sampled, ends
    generation and is not returned). `on_logits`, if given, is called with each step's next-token
    logits, `on_token` with each new token as it is chosen (streaming).

    `constraint`, if given, restricts which tokens may come next (grammar-constrained decoding,
    lmforge/structured/constrain.py): before each step `constraint.finished()` may end generation,
    `constraint.allowed(vocab_size)` gives a boolean mask over the vocabulary (None: any token) that
    is applied to the logits before temperature, top-k and top-p, and `constraint.consume(token)` is
    told each token chosen (the stop token included). The mask concerns only the tokens generated,
    so it works unchanged with the KV cache and its context restarts.

    `cache`, if given, is the KVCache to fill from position `cached` (grown as needed: several
    samples can share one); by default a new one for len(prompt) + max_new_tokens positions.
    `cached` > 0: the cache already holds prompt[:cached] (a chat's earlier turns), which is not
    run again; generate() leaves cache.start and cache.length saying what it holds.

    This is `generate_batch` on a batch of one: the same loop decodes one prompt and many."""
    streamed = None if on_token is None else lambda row, token: on_token(token)
    return generate_batch(model, [prompt], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          stop_token=stop_token, seed=seed, use_cache=use_cache, on_logits=on_logits,
                          constraints=[constraint], cache=cache, cached=cached, on_token=streamed)[0]


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None,
                   stop_token: int | Collection[int] | None = None, seed: int = 0, use_cache: bool = True,
                   on_logits=None, constraints: list | None = None, cache: KVCache | None = None, cached: int = 0,
                   on_token=None) -> list[list[int]]:
    """The new token ids continuing each of `prompts`, decoded together, one row each (see generate()
    for the options). Each row stops on its own, at a stop token or when its constraint
    (`constraints[i]`) is finished; a finished row leaves the batch and no longer changes, and the
    others go on. `on_token(row, token)`; `on_logits` gets the logits of the rows still decoding.
    `cache` and `cached` (a chat's) continue one prompt; a batch gets a cache of its own.

    The rows are left-padded in the cache's columns (generate/batch.py says why and how): greedy, a
    row decodes as it would alone (sampled, the rows draw from one generator, so not the same tokens)."""
    if not prompts or not all(prompts):
        raise ValueError("generation needs a prompt of at least one token")
    if len(prompts) > 1 and (cache is not None or cached):
        raise ValueError("a given cache continues one prompt; a batch of prompts makes its own")
    if cached >= len(prompts[0]) or cached and not use_cache:
        raise ValueError(f"{cached} positions cached of a prompt of {len(prompts[0])}: at least one must be run")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    max_len = model.cfg.max_seq_len
    stops = {stop_token} if isinstance(stop_token, int) else set(stop_token or ())
    constraints = list(constraints or [None] * len(prompts))
    rows, done = Rows(prompts, max_len, cached), set()
    kv = None  # the cache being filled (in a batch, a copy holding the rows still decoding)
    if use_cache:
        kv = cache if cache is not None else KVCache.for_model(model, max(rows.windows()) + max_new_tokens,
                                                               batch=len(prompts))
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        done |= {r for r in rows.live if constraints[r] is not None and constraints[r].finished()}
        decoding = len(rows.live)
        kept = rows.keep(done)
        if not kept:
            break
        if kv is not None and len(kept) < decoding:
            kv = kv.rows(torch.tensor(kept, device=device))
        restarted = rows.restart()
        width = rows.pads[0] + rows.windows()[0]  # the columns once this step's tokens are in
        if restarted or width > max_len or not use_cache or not cached and len(kept) > 1:
            width, cached = rows.place(), 0
        logits = decode_step(model, rows.feeds(cached), rows.pads, width, kv, cached, device)
        cached = width if use_cache else 0
        if on_logits is not None:
            on_logits(logits)
        chosen = choose_next(logits, [constraints[r] for r in rows.live], temperature, top_k, top_p, generator)
        for r, token in zip(rows.live, chosen):
            if token in stops:
                done.add(r)
                continue
            rows.tokens[r].append(token)
            new_tokens[r].append(token)
            if on_token is not None:
                on_token(r, token)
    if cache is not None and len(prompts) == 1:
        cache.start, cache.length = rows.starts[0], cached
    return new_tokens
