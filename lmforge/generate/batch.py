"""The rows of generate_batch (generate/sampling.py): many prompts decoded in one batch.

The rows are left-padded: every row's newest token is in the same column of the KV cache, so each
step feeds one column for the whole batch and writes one column of the cache (one start_pos for all
rows), as a single prompt does. The model is told which columns hold tokens (Transformer.forward's
`valid`), so padding is never attended to and a token's position (rotary angle, learned position) is
the number of tokens before it in its row, as it would be alone. Right padding would put each row's
next token in a different column, a cache write per row. A prompt runs one row at a time into its
own columns (decode_step); the steps after it run as one batch. When a row's window restarts (the
context outgrew the model's positions: sampling.py's module docstring) or the columns would outgrow
them once finished rows have left, every row's window is run again from column 0, its padding
squeezed out.
"""

import torch

from lmforge.model.transformer import Transformer


class Rows:
    """The rows of generate_batch as they grow: each row's tokens, the first position of its context
    window (`starts`), its left padding in the cache's columns (`pads`), and the rows still decoding
    (`live`, in the order of the cache's rows; `pads` follows it)."""

    def __init__(self, prompts: list[list[int]], max_len: int, cached: int):
        self.tokens = [list(prompt) for prompt in prompts]
        self.starts = [0 if cached else max(0, len(row) - max_len) for row in self.tokens]
        self.live, self.pads, self.max_len = list(range(len(prompts))), [0] * len(prompts), max_len

    def windows(self) -> list[int]:
        """The length of each live row's window."""
        return [len(self.tokens[r]) - self.starts[r] for r in self.live]

    def keep(self, done: set[int]) -> list[int]:
        """The live rows less those in `done`: the indices, among the live rows before, of those kept."""
        kept = [i for i, r in enumerate(self.live) if r not in done]
        self.live, self.pads = [self.live[i] for i in kept], [self.pads[i] for i in kept]
        return kept

    def restart(self) -> bool:
        """A window that outgrew the model's positions restarts from its latest max_len // 2 tokens
        (the module docstring), as it would alone; whether one did."""
        restarted = False
        for r in self.live:
            if len(self.tokens[r]) - self.starts[r] > self.max_len:
                self.starts[r], restarted = len(self.tokens[r]) - self.max_len // 2, True
        return restarted

    def place(self) -> int:
        """Every window left-padded to the longest, from column 0: the columns they fill."""
        windows = self.windows()
        self.pads = [max(windows) - window for window in windows]
        return max(windows)

    def feeds(self, cached: int) -> list[list[int]]:
        """Each live row's tokens not yet in the cache's first `cached` columns."""
        return [self.tokens[r][self.starts[r] + max(0, cached - pad):] for r, pad in zip(self.live, self.pads)]


def decode_step(model: Transformer, feeds: list[list[int]], pads: list[int], width: int, cache, cached: int,
                device: torch.device) -> torch.Tensor:
    """Next-token logits (rows, vocab) after each row's `feeds`, the columns [cached, width) of the
    row left-padded by `pads[i]` columns. `cache`: sampling.py's KVCache holding columns [0, cached),
    or None (no cache: the whole windows are fed).

    A prompt (nothing cached) runs one row at a time into its columns of the cache: on a whole prompt
    the work per token is large enough that a batch gains little, a row alone needs no mask (the
    fused causal attention) and holds only its own logits, and it computes exactly what it would
    alone. The steps after it, one token per row, run as one batch."""
    if cache is not None:
        cache.reserve(width)
        if cached == 0:
            return torch.cat([model(torch.tensor([row], device=device), kv_cache=cache.row_from(i, pad), last=1)[:, -1]
                              for i, (row, pad) in enumerate(zip(feeds, pads))])
    feed = torch.tensor([[0] * (width - cached - len(row)) + row for row in feeds], device=device)
    valid = None  # no padding: every column holds a token
    if any(pads):
        valid = torch.arange(width, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]
    return model(feed, kv_cache=cache, start_pos=cached, valid=valid, last=1)[:, -1]
