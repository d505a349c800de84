import pytest
import torch

from lmforge.config import make_config
from lmforge.generate.sampling import generate, generate_batch, sample_next
from lmforge.model.transformer import Transformer


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_cached_and_uncached_generation_give_the_same_logits(family):
    overrides = [f"model.family={family}", "model.max_seq_len=32"]
    if family == "gpt":
        overrides.append("model.n_kv_heads=null")
    cfg = make_config("tiny", overrides=overrides).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (10,)).tolist()
    recorded = {True: [], False: []}
    outputs = {}
    for use_cache in (True, False):
        # 60 new tokens from a window of 32: the context restarts twice on the way
        outputs[use_cache] = generate(model, prompt, 60, temperature=0, use_cache=use_cache,
                                      on_logits=lambda logits, c=use_cache: recorded[c].append(logits))
    assert outputs[True] == outputs[False]
    assert len(recorded[True]) == 60
    for cached, uncached in zip(recorded[True], recorded[False]):
        torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_equals_one_forward_pass():
    cfg = make_config("tiny").model
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 20))
    from lmforge.generate.sampling import KVCache

    cache = KVCache(cfg.n_layers, 1, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        full = model(tokens)
        parts = [model(tokens[:, :13], kv_cache=cache, start_pos=0)]
        parts += [model(tokens[:, i:i + 1], kv_cache=cache, start_pos=i) for i in range(13, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_stop_token_ends_generation():
    cfg = make_config("tiny").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    greedy = generate(model, [1, 2, 3], 5, temperature=0)
    assert len(greedy) == 5
    stop = greedy[-1]
    assert generate(model, [1, 2, 3], 5, temperature=0, stop_token=stop) == greedy[:greedy.index(stop)]


def test_sampling_is_seeded():
    cfg = make_config("tiny").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    a = generate(model, [5], 20, seed=1)
    assert a == generate(model, [5], 20, seed=1)
    assert a != generate(model, [5], 20, seed=2)


def support(logits, n=2000, **kwargs):
    generator = torch.Generator().manual_seed(0)
    return {int(sample_next(logits, generator=generator, **kwargs)) for _ in range(n)}


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert support(logits) == {0, 1, 2, 3}
    assert support(logits, top_k=2) == {0, 1}
    assert support(logits, top_k=1) == {0}
    assert support(logits, top_p=0.5) == {0}       # 0.5 alone reaches the mass
    assert support(logits, top_p=0.7) == {0, 1}
    assert support(logits, top_p=0.85) == {0, 1, 2}
    assert support(logits, temperature=0) == {0}


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([[0.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    draws = lambda t: sum(int(sample_next(logits, temperature=t, generator=generator)) for _ in range(4000)) / 4000
    p1 = torch.softmax(logits, -1)[0, 1].item()  # 0.731
    assert abs(draws(1.0) - p1) < 0.03
    assert draws(0.25) > 0.95


def test_empty_prompt_is_refused():
    model = Transformer(make_config("tiny").model)
    with pytest.raises(ValueError, match="needs a prompt"):
        generate(model, [], 3)


class StopAfter:
    """A constraint that allows every token and finishes after `n` of them."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def allowed(self, vocab_size):
        return None

    def consume(self, token):
        self.seen += 1

    def finished(self):
        return self.seen >= self.n


@pytest.mark.parametrize("overrides", [["model.family=llama"], ["model.family=gpt", "model.n_kv_heads=null"],
                                       ["model.family=llama", "model.sliding_window=6"]])
def test_a_batch_decodes_each_prompt_token_for_token_as_it_would_alone(overrides):
    # 32 positions: the 45-token prompt is cut to its window, and every row's window restarts on the way
    cfg = make_config("tiny", overrides=[*overrides, "model.max_seq_len=32"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (3, 11, 20, 45, 1)]
    alone = [generate(model, p, 40, temperature=0) for p in prompts]
    assert generate_batch(model, prompts, 40, temperature=0) == alone
    assert generate_batch(model, prompts, 40, temperature=0, use_cache=False) == alone

    # each row stops on its own (a stop token where it first comes, a constraint after n tokens);
    # the others go on, and a finished row no longer changes
    stop = alone[1][7]
    stopped = [generate(model, p, 40, temperature=0, stop_token=stop) for p in prompts]
    assert stopped == [a[:a.index(stop)] if stop in a else a for a in alone]
    assert generate_batch(model, prompts, 40, temperature=0, stop_token=stop) == stopped
    counts = [5, 40, 0, 17, 2]
    assert generate_batch(model, prompts, 40, temperature=0,
                          constraints=[StopAfter(n) for n in counts]) == [a[:n] for a, n in zip(alone, counts)]


def test_a_batch_refuses_a_given_cache_and_empty_prompts():
    model = Transformer(make_config("tiny").model)
    with pytest.raises(ValueError, match="needs a prompt"):
        generate_batch(model, [[1, 2], []], 3)
    from lmforge.generate.sampling import KVCache
    with pytest.raises(ValueError, match="continues one prompt"):
        generate_batch(model, [[1, 2], [3]], 3, cache=KVCache.for_model(model, 8, batch=2))
