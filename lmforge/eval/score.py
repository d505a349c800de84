"""Log-likelihood scoring of multiple-choice questions, as lm-evaluation-harness defines it.

Each choice is a (context, continuation) pair. Its score is the summed log-probability of the
continuation's tokens given the context, log p(cont | ctx) = sum_i log p(cont_i | ctx, cont_<i)
(Gao et al., lm-evaluation-harness, `loglikelihood`; Brown et al. 2020 section 2.4 for the
ranked-classification use). The tokens are split as lm-eval's `_encode_pair` splits them: trailing
spaces of the context move to the continuation, the pair is encoded whole, and the continuation is
what follows the context's own encoding (so a token spanning the boundary belongs to the
continuation). An empty context is the end-of-text token.

Speed: the choices of a question share their context, and questions are scored many at a time.
Questions are sorted by context length and batched (contexts at most a third longer than the
batch's shortest, up to TOKENS positions of padded contexts and choices' tokens). A batch's
contexts run through the model once, together, right-padded (a causal model's positions before the
padding cannot see it), into one KV cache (generate/sampling.py's KVCache). Each context's row is
copied to one row per choice, and the choices' tokens run from position P, the batch's longest
context length: longest first, in parts that pad a row by at most a quarter of the part's longest
(padded to the batch's longest instead, PIQA's 2- to 100-token solutions ran 3x their tokens). A
row whose context is shorter holds padding between its context and P: the model is told which
positions hold tokens (Transformer.forward's `valid`), so that padding is never attended to and the
choice's tokens keep their true positions. Where context and the longest choice exceed the model's
positions, each choice is instead scored alone on the window lm-eval uses,
(context + continuation)[-(max_seq_len + 1):][:-1] (the context truncated from the left), and the
question is counted as truncated.
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


@torch.no_grad()
def score_alone(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) on lm-eval's window: the last max_seq_len + 1 tokens, less the last.
    A continuation longer than the model's positions (lm-eval refuses it) has its last max_seq_len
    tokens scored."""
    window = (context + continuation)[-(model.cfg.max_seq_len + 1):]
    scored = continuation[-(len(window) - 1):]
    device = next(model.parameters()).device
    logits = model(torch.tensor([window[:-1]], device=device), last=len(scored))[0]
    return float(token_logprobs(logits, torch.tensor(scored, device=device)).sum())


TOKENS = 4096  # padded positions (contexts, then choices) per batch: large enough that a forward's fixed cost is shared


def _longest_first_parts(rows: list[int], continuations: list[list[int]], tokens: int = TOKENS) -> list[list[int]]:
    """`rows` longest continuation first, in runs of at most `tokens` padded positions that pad each row
    by at most a quarter of the run's first (longest) length."""
    parts = []
    for row in sorted(rows, key=lambda r: -len(continuations[r])):
        first = len(continuations[parts[-1][0]]) - 1 if parts else 0
        if not parts or (len(parts[-1]) + 1) * first > tokens or 4 * (len(continuations[row]) - 1) < 3 * first:
            parts.append([])
        parts[-1].append(row)
    return parts


@torch.no_grad()
def score_shared(model, groups: list[tuple[list[int], list[list[int]]]]) -> list[list[float]]:
    """log p(continuation | context) of each group's continuations, every context run once, in one batch,
    and every continuation in a second (see the module docstring)."""
    device = next(model.parameters()).device
    lengths = torch.tensor([len(context) for context, _ in groups], device=device)
    width, longest = int(lengths.max()), max(len(c) for _, conts in groups for c in conts)
    contexts = torch.zeros(len(groups), width, dtype=torch.long, device=device)
    for row, (context, _) in enumerate(groups):
        contexts[row, :len(context)] = torch.tensor(context)
    cache = KVCache.for_model(model, width + longest - 1, batch=len(groups))
    hidden = model.run_blocks(model.embed(contexts), cache)
    last = model.head(hidden[torch.arange(len(groups)), lengths - 1])  # each context's last token predicts each first
    owner = torch.tensor([g for g, (_, conts) in enumerate(groups) for _ in conts], device=device)
    continuations = [c for _, conts in groups for c in conts]
    scores = token_logprobs(last[owner], torch.tensor([c[0] for c in continuations], device=device))
    # the rest: every choice's tokens but its last, from position `width`, longest first in parts
    for part in _longest_first_parts([r for r, c in enumerate(continuations) if len(c) > 1], continuations):
        rows, n = torch.tensor(part, device=device), len(continuations[part[0]]) - 1
        feed, targets = (torch.zeros(len(part), n, dtype=torch.long, device=device) for _ in range(2))
        counted = torch.zeros(feed.shape, dtype=torch.bool, device=device)
        for row, tokens in enumerate(continuations[r] for r in part):
            feed[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            targets[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
            counted[row, :len(tokens) - 1] = True
        valid = None  # every context as long as the longest: no padding between context and choice
        if bool((lengths[owner[rows]] < width).any()):
            valid = torch.arange(width + n, device=device)[None, :] < lengths[owner[rows], None]
            valid[:, width:] = True
        logits = model(feed, kv_cache=cache.rows(owner[rows]), start_pos=width, valid=valid)
        scores[rows] += (token_logprobs(logits, targets) * counted).sum(dim=1)
    per_group, at = [], 0
    for _, conts in groups:
        per_group.append(scores[at:at + len(conts)].tolist())
        at += len(conts)
    return per_group


def batches(groups: list[tuple[list[int], list[list[int]]]], max_len: int, tokens: int = TOKENS) -> list[list[int]]:
    """The groups' indices in batches: sorted by context length (less padding), each batch as many as
    fit in `tokens` positions (contexts padded, choices counted as their tokens) and in the model's
    max_len positions, with contexts at most a third longer than its shortest."""
    out, shortest, width, longest, chosen = [], 0, 0, 0, 0
    for index in sorted(range(len(groups)), key=lambda i: len(groups[i][0])):
        context, conts = groups[index]
        choice_tokens = sum(len(c) - 1 for c in conts)  # run in parts padded to little more than their tokens
        if out:  # into the current batch if it still fits there
            w, n, c = max(width, len(context)), max(longest, max(map(len, conts))), chosen + choice_tokens
            if w * (len(out[-1]) + 1) + c <= tokens and w + n - 1 <= max_len and 3 * w <= 4 * shortest:
                out[-1].append(index)
                width, longest, chosen = w, n, c
                continue
        out.append([index])  # a new batch: its contexts padded by at most a third of the shortest
        shortest = width = len(context)
        longest, chosen = max(map(len, conts)), choice_tokens
    return out


def score_questions(model, tokenizer, questions: list[tuple[list[str], list[str]]], end_id: int) -> list[
        tuple[list[Scored], bool]]:
    """Each question's (contexts, continuations) scored: every choice's Scored, and whether a context
    had to be truncated. Choices sharing a context (all but Winogrande's) are scored together from
    its cache, and many questions' in one batch."""
    pairs = [[encode_pair(tokenizer, c, k, end_id) for c, k in zip(*q)] for q in questions]
    groups, members, logprobs, truncated = [], [], [{} for _ in questions], [False] * len(questions)
    for q, question in enumerate(pairs):
        shared: dict[tuple[int, ...], list[int]] = {}
        for index, (context, _) in enumerate(question):
            shared.setdefault(tuple(context), []).append(index)
        for context, indices in shared.items():
            conts = [question[i][1] for i in indices]
            if len(context) + max(len(c) for c in conts) - 1 <= model.cfg.max_seq_len:
                groups.append((list(context), conts))
                members.append((q, indices))
                continue
            truncated[q] = True
            for i, cont in zip(indices, conts):
                logprobs[q][i] = score_alone(model, list(context), cont)
    for batch in batches(groups, model.cfg.max_seq_len):
        for g, scores in zip(batch, score_shared(model, [groups[g] for g in batch])):
            q, indices = members[g]
            logprobs[q].update(zip(indices, scores))
    return [([Scored(logprobs[q][i], len(cont)) for i, (_, cont) in enumerate(question)], truncated[q])
            for q, question in enumerate(pairs)]

