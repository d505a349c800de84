"""Texts continuing a prompt, as `lmforge generate` prints them: one per sample, sample i drawn
with seed + i, so that each can be drawn again alone."""

import sys
from collections.abc import Iterable, Iterator

from lmforge.common.errors import LmforgeError
from lmforge.generate.sampling import generate


def prompt_ids(tokenizer, prompt: str, end: int) -> list[int]:
    """The prompt's token ids; an empty prompt starts a document (the end-of-document token `end`)."""
    return tokenizer.encode(prompt).ids if prompt else [end]


def samples(model, tokenizer, prompt: str, end: int, max_new_tokens: int, *, num_samples: int = 1, seed: int = 0,
            constrained=None, stops=None, **sampling) -> Iterator[str]:
    """The prompt followed by each sample's continuation, which ends at a stop token (`stops`, the
    model's: by default `end`) or after max_new_tokens. `sampling`: generate's temperature, top_k,
    top_p and use_cache.

    `constrained`, if given, decodes instead: its generate(model, ids, max_new_tokens, seed=..., **sampling)
    returns the answer alone, .text, and whether it was finished, .complete (structured/constrain.py's
    JsonMode); an answer cut by max_new_tokens is an error."""
    ids = prompt_ids(tokenizer, prompt, end)
    for index in range(num_samples):
        if constrained is None:
            new = generate(model, ids, max_new_tokens, stop_token=stops or end, seed=seed + index, **sampling)
            yield prompt + tokenizer.decode(new)
            continue
        out = constrained.generate(model, ids, max_new_tokens, seed=seed + index, **sampling)
        if not out.complete:
            raise LmforgeError(f"the answer{f' of sample {index + 1}' if num_samples > 1 else ''} was cut "
                               f"at --max-new-tokens {max_new_tokens} before its JSON closed: raise --max-new-tokens")
        yield out.text


def print_samples(texts: Iterable[str], num_samples: int) -> None:
    """Print each text, under a '--- sample i ---' line when there are several."""
    for index, text in enumerate(texts):
        if num_samples > 1:
            print(f"--- sample {index + 1} ---")
        print(text)


def print_stats(model, cache, source) -> None:
    """`lmforge generate --stats`: the bytes of the weights and of the KV cache generation filled
    (to stderr), as `lmforge plan --inference` counts them; `source`, the folder the model came from."""
    params = list(dict.fromkeys(model.parameters()))  # tied parameters once
    dtype = str(params[0].dtype).removeprefix("torch.")
    print(f"weights: {sum(p.numel() for p in params):,} parameters in {dtype}, "
          f"{sum(p.nbytes for p in params):,} bytes", file=sys.stderr)
    if cache is not None:
        print(f"KV cache: {cache.capacity:,} positions in {str(cache.keys.dtype).removeprefix('torch.')}, "
              f"{cache.nbytes:,} bytes (lmforge plan --inference {source} --seq-len {cache.capacity} predicts it)",
              file=sys.stderr)
