"""Log-likelihood scoring of multiple-choice questions, as lm-evaluation-harness defines it.

Each choice is a (context, continuation) pair. Its score is the summed log-probability of the
continuation's tokens given the context, log p(cont | ctx) = sum_i log p(cont_i | ctx, cont_<i)
(Gao et al., lm-evaluation-harness, `loglikelihood`; Brown et al. 2020 section 2.4 for the
ranked-classification use). The tokens are split as lm-eval's `_encode_pair` splits them: trailing
spaces of the context move to the continuation, the pair is encoded whole, and the continuation is
what follows the context's own encoding (so a token spanning the boundary belongs to the
continuation). An empty context is the end-of-text token.

Speed: the choices of a question share their context. It is run through the model once, into a
KV cache (generate/sampling.py's KVCache), which is then copied to one row per choice; all the
choices' tokens then run in one batch from position len(context). Each row is right-padded, which
cannot change the positions before the padding in a causal model. Where context and the longest
choice exceed the model's positions, each choice is instead scored alone on the window lm-eval
uses, (context + continuation)[-(max_seq_len + 1):][:-1] (the context truncated from the left),
and the question is counted as truncated.
"""

from dataclasses import dataclass

import torch

from lmforge.generate.sampling import KVCache


@dataclass
class Scored:
    """A choice's summed log-probability and its continuation's token count."""
    logprob: float
    tokens: int


def encode_pair(tokenizer, context: str, continuation: str, end_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HFLM splits them (see the module docstring)."""
    if not context:
        return [end_id], tokenizer.encode(continuation).ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation).ids
    context_ids = tokenizer.encode(context).ids
    return context_ids, whole[len(context_ids):]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] for each position: (..., vocab) and (...) -> (...), in fp32 at least."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def tail_logits(model, tokens: torch.Tensor, last: int, kv_cache=None) -> torch.Tensor:
    """The logits of the last `last` positions only: the LM head is not run over a whole context
    (at a 128k vocabulary, 2,000 positions of fp32 logits would be 1 GB)."""
    hidden = model.run_blocks(model.embed(tokens), kv_cache)
    return model.head(hidden[:, -last:])


@torch.no_grad()
def score_alone(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) on lm-eval's window: the last max_seq_len + 1 tokens, less the last.
    A continuation longer than the model's positions (lm-eval refuses it) has its last max_seq_len
    tokens scored."""
    window = (context + continuation)[-(model.cfg.max_seq_len + 1):]
    scored = continuation[-(len(window) - 1):]
    device = next(model.parameters()).device
    logits = tail_logits(model, torch.tensor([window[:-1]], device=device), len(scored))[0]
    return float(token_logprobs(logits, torch.tensor(scored, device=device)).sum())


@torch.no_grad()
def score_shared(model, context: list[int], continuations: list[list[int]]) -> list[float]:
    """log p(continuation | context) of each continuation, the context run once (see the module docstring)."""
    device = next(model.parameters()).device
    longest = max(len(c) for c in continuations)
    one = KVCache.for_model(model, len(context))
    last = tail_logits(model, torch.tensor([context], device=device), 1, one)[0, -1]  # predicts each first token
    first = torch.tensor([c[0] for c in continuations], device=device)
    scores = token_logprobs(last.expand(len(continuations), -1), first)
    if longest > 1:  # the rest: every choice's tokens but its last, one row each, from position len(context)
        rows = KVCache.for_model(model, len(context) + longest - 1, batch=len(continuations))
        rows.keys[:, :, :, :len(context)] = one.keys[:, :, :, :len(context)]
        rows.values[:, :, :, :len(context)] = one.values[:, :, :, :len(context)]
        feed = torch.zeros(len(continuations), longest - 1, dtype=torch.long, device=device)
        targets = torch.zeros_like(feed)
        mask = torch.zeros(feed.shape, dtype=torch.bool, device=device)
        for row, tokens in enumerate(continuations):
            feed[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            targets[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
            mask[row, :len(tokens) - 1] = True
        logits = model(feed, kv_cache=rows, start_pos=len(context))
        scores = scores + (token_logprobs(logits, targets) * mask).sum(dim=1)
    return scores.tolist()


def score_question(model, tokenizer, contexts: list[str], continuations: list[str], end_id: int) -> tuple[
        list[Scored], bool]:
    """Each choice's Scored, and whether a context had to be truncated. Choices sharing a context
    (all but Winogrande's) are scored together from its cache."""
    pairs = [encode_pair(tokenizer, c, k, end_id) for c, k in zip(contexts, continuations)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (context, _) in enumerate(pairs):
        groups.setdefault(tuple(context), []).append(index)
    logprobs: dict[int, float] = {}
    truncated = False
    for context, members in groups.items():
        conts = [pairs[i][1] for i in members]
        if len(context) + max(len(c) for c in conts) - 1 <= model.cfg.max_seq_len:
            logprobs.update(zip(members, score_shared(model, list(context), conts)))
            continue
        truncated = True
        for i, cont in zip(members, conts):
            logprobs[i] = score_alone(model, list(context), cont)
    return [Scored(logprobs[i], len(pairs[i][1])) for i in range(len(pairs))], truncated
