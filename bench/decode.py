"""Decode speed on this machine beside `lmforge plan --inference`'s prediction, in one run.

    nice -n 10 python bench/decode.py [--steps 16] [--batches 1,8] [--contexts 256,2048] [key=value ...]

The model (default: a ~110M-parameter Llama with grouped-query attention, fp32, random weights:
decode time does not depend on the values) decodes `--steps` tokens per sequence for each batch
size and context length. `lmforge generate` decodes one sequence at a time (generate/sampling.py
has a batch of 1), so this runs the same decode loop it runs (the model's forward on the newest
token with the KV cache) directly, with a batch of b. The cache is filled with random keys and
values up to the context instead of by a prefill: a prefill of 8 x 2048 tokens would take minutes
on a 2-core CPU and changes nothing in a decode step's work.

The prediction is the plan's decode step at the middle of the measured steps' contexts, on this
machine's measured memory bandwidth and fp32 matmul peak (accounting/hardware.py, cached): the
bytes a step reads (weights, less the embedding table, plus the KV cache) over the bandwidth,
unless its FLOPs take longer. Printed: median ms per step, tokens/s measured and predicted, and
their ratio.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.accounting.hardware import this_bandwidth, this_device  # noqa: E402
from lmforge.accounting.plan.inference import InferenceSetup, make_inference_plan  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.generate.sampling import KVCache  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402

MODEL = ["model.vocab_size=32000", "model.d_model=768", "model.n_layers=12", "model.n_heads=12",
         "model.n_kv_heads=4", "model.max_seq_len=4096"]


@torch.no_grad()
def decode_seconds_per_step(model: Transformer, batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median seconds of one decode step for `batch` sequences whose cache holds `context` tokens:
    wall-clock, and CPU time over the thread count (what the step would take on a machine it had
    to itself: other work on a shared machine stretches the first and not the second)."""
    cfg = model.cfg
    cache = KVCache(cfg.n_layers, batch, cfg.kv_heads, context + steps, cfg.head_dim, torch.float32,
                    torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cache.keys[:, :, :, :context].normal_(generator=generator)
    cache.values[:, :, :, :context].normal_(generator=generator)
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    wall, cpu = [], []
    for step in range(steps + 1):  # the first step warms up
        started, started_cpu = time.perf_counter(), time.process_time()
        logits = model(tokens, kv_cache=cache, start_pos=context + step)[:, -1]
        tokens = logits.argmax(dim=-1, keepdim=True)  # greedy, as `lmforge generate --temperature 0`
        wall.append(time.perf_counter() - started)
        cpu.append((time.process_time() - started_cpu) / torch.get_num_threads())
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("overrides", nargs="*", help="model overrides on top of the default bench model")
    args = parser.parse_args()
    cfg = make_config("small", overrides=[*MODEL, *args.overrides]).model
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    device = torch.device("cpu")
    name, peak, memory = this_device("float32", device)
    bandwidth = this_bandwidth("float32", device)
    machine = (name, peak, memory, bandwidth)
    print(f"# {cfg.family}, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.kv_heads} kv), "
          f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M parameters, fp32; {name}, "
          f"torch {torch.__version__}")
    print(f"# measured: memory bandwidth {bandwidth / 1e9:.2f} GB/s (matrix-vector), fp32 matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s; load average {os.getloadavg()[0]:.1f}; {args.steps} steps, median")
    print("| batch | context | predicted ms/step | bound | measured ms/step (CPU ms / threads) | "
          "predicted tokens/s | measured tokens/s | measured / predicted (by CPU time) |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            middle = context + args.steps // 2
            plan = make_inference_plan(cfg, InferenceSetup(batch_size=batch, seq_len=middle, weights="fp32",
                                                           kv_dtype="fp32", hardware="this", reserve_bytes=0),
                                       machine)
            predicted = plan["decode"]["seconds_per_step"]
            measured, cpu = decode_seconds_per_step(model, batch, context, args.steps)
            print(f"| {batch} | {context} | {predicted * 1e3:.1f} | {plan['decode']['bound']} | {measured * 1e3:.1f} "
                  f"({cpu * 1e3:.1f}) | {batch / predicted:,.1f} | {batch / measured:,.1f} | "
                  f"{predicted / measured:.2f} ({predicted / cpu:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
