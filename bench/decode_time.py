"""Predicted (roofline) against measured decode tokens/s, one process, eager, fp32.

For each model and batch: the roofline's decode step (accounting/roofline/decode.py: one step of
generate()'s loop traced on fake tensors, priced at this machine's measured roof with its GEMV
rates and no-grad launch costs: accounting/roofline/decode.py), then the real thing with random
weights (decode time does not depend on their values) and a KV cache filled with random keys
and values up to the context (a prefill changes nothing in a decode step's work):

- batch 1: lmforge's own generate() (greedy), continuing a cache that holds `context` positions
  of the prompt, `--tokens` new tokens, seconds per token;
- batch b > 1: the steps generate_batch() runs once its prompts are in (the model's cached
  forward on each sequence's newest token, then the greedy choice), on b sequences at once; it
  fills its own cache from the prompts, so the steps are timed here on the filled one.

Each is timed after a warm-up run, as the median of `--repeats` runs (also shown against the best
run, the statistic the roof is measured with, and against the process's CPU time: on a machine
that other work shares, the three differ, and the best and CPU-time ratios are the ones to read;
on an idle machine they agree); predicted at the middle of the contexts the measured tokens saw.

    python bench/decode_time.py [--models tiny,small] [--batches 1,8] [--context 128] [--tokens 16]
                                [--repeats 5] [--remeasure]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.accounting.roofline.decode import decode_roof, this_decode_measurements  # noqa: E402
from lmforge.accounting.roofline.measure import this_roof  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.accounting.roofline.decode import predict_decode  # noqa: E402
from lmforge.generate.sampling import KVCache, generate, sample_next  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402
from lmforge.train.roofline import decode_step  # noqa: E402


def filled_cache(model: Transformer, batch: int, context: int, tokens: int) -> KVCache:
    cache = KVCache.for_model(model, context + tokens + 1, batch)
    generator = torch.Generator().manual_seed(0)
    cache.keys[:, :, :, :context].normal_(generator=generator)
    cache.values[:, :, :, :context].normal_(generator=generator)
    return cache


@torch.no_grad()
def seconds_per_token_step(model: Transformer, batch: int, context: int, tokens: int) -> tuple[float, float]:
    """(wall-clock, CPU) seconds per decode step of `tokens` steps from `context` cached positions.
    CPU time over the threads is what the step takes on a machine it has to itself: other work on a
    shared machine stretches the wall clock, not the process's CPU time."""
    cache = filled_cache(model, batch, context, tokens)
    started, started_cpu = time.perf_counter(), time.process_time()
    if batch == 1:  # generate() runs prompt[context:] (one token), then decodes: tokens steps in all
        generate(model, [0] * (context + 1), tokens, temperature=0.0, cache=cache, cached=context)
    else:
        feed = torch.zeros(batch, 1, dtype=torch.long)
        for step in range(tokens):
            logits = model(feed, kv_cache=cache, start_pos=context + step)[:, -1]
            feed = sample_next(logits, temperature=0.0)[:, None]
    cpu = (time.process_time() - started_cpu) / torch.get_num_threads()
    return (time.perf_counter() - started) / tokens, cpu / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128, help="cached positions (at most the model's context)")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--remeasure", action="store_true", help="measure the roof (and its decode part) again")
    args = parser.parse_args()
    device = torch.device("cpu")
    roof = decode_roof(this_roof(device, remeasure=args.remeasure),
                       this_decode_measurements(decode_step, device, remeasure=args.remeasure))
    print(f"roof: {roof.name}; {torch.get_num_threads()} threads, torch {torch.__version__}; decode call "
          f"{roof.call_seconds * 1e6:.2f} us per operator")
    print(f"{'model':<8}{'batch':>6}{'context':>9}{'predicted tok/s':>17}{'measured tok/s':>16}"
          f"{'predicted/measured':>20}{'(best)':>8}{'(CPU time)':>12}  by class (predicted ms per step)")
    for name in args.models.split(","):
        cfg = make_config(name).model
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
        context = max(1, min(args.context, cfg.max_seq_len - args.tokens - 1))
        for batch in (int(b) for b in args.batches.split(",")):
            seconds_per_token_step(model, batch, context, args.tokens)  # warm-up
            runs = [seconds_per_token_step(model, batch, context, args.tokens) for _ in range(args.repeats)]
            wall, cpu = (statistics.median(r[i] for r in runs) for i in (0, 1))
            best = min(r[0] for r in runs)
            predicted = predict_decode(decode_step, cfg, batch, context + args.tokens // 2, roof)
            tokens_per_s = predicted["tokens_per_second"]
            classes = ", ".join(f"{cls} {row['seconds'] * 1e3:.3f} ({row['bound']})"
                                for cls, row in predicted["classes"].items())
            print(f"{name:<8}{batch:>6}{context:>9}{tokens_per_s:>17,.0f}{batch / wall:>16,.0f}"
                  f"{tokens_per_s * wall / batch:>20.3f}{tokens_per_s * best / batch:>8.3f}"
                  f"{tokens_per_s * cpu / batch:>12.3f}  {classes}")


if __name__ == "__main__":
    main()
