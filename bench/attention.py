"""Attention backends side by side: forward and forward+backward time, and bytes saved for backward.

    python bench/attention.py [--quick] [--lengths 128 256 ...] [--batch 1] [--heads 8]
                              [--kv-heads 8] [--head-dim 64] [--dtype fp32|bf16] [--repeats 5]

One causal self-attention call of shape (batch, heads, T, head_dim) per measurement, for each
available backend and length T, all in this process so that the ratios against `sdpa` compare
like with like. Time is the best of --repeats runs after a warm-up, the backends taking turns;
"fwd" is a forward pass with inputs that require grad (as in training), "fwd+bwd" adds the
backward pass. Saved bytes are
what autograd keeps for backward (lmforge.accounting.measure), measured once per cell.
Attention FLOPs per call: 4 * B * H * T^2 * d forward (two matmuls), 2.5x that backward (five
matmuls, dQ/dK/dV/dP plus the recomputed S), halved for the causal mask; the fwd+bwd FLOP rate
uses their sum. flash_torch recomputes S, so for it "useful" FLOP/s slightly understates the work.

On CPU `flash_triton` would run in Triton's interpreter, which is not a speed path: it is left
out there. `naive` is skipped above --naive-max-len (its T x T tensors grow as T^2).
Writes bench/out/attention.png (time and saved memory against T) and prints a markdown table.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.accounting.measure import measure_saved_bytes  # noqa: E402
from lmforge.kernels import flash_triton  # noqa: E402
from lmforge.model.attention import attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths 128..512, 2 repeats: a smoke run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive-max-len", type=int, default=None,
                        help="skip naive above this length (default: 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "attention.png")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = [128, 256, 512], 2
    return args


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def make_calls(backend, seq_len, args, device, dtype):
    """(forward, forward_backward) closures over fresh random inputs for one cell."""
    shape_q = (args.batch, args.heads, seq_len, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, seq_len, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape_q, device=device, dtype=dtype)

    def forward():
        return attention(q, k, v, causal=True, backend=backend)

    def forward_backward():
        torch.autograd.grad(forward(), (q, k, v), grad_out)

    return forward, forward_backward


def measure_length(backends, seq_len, args, device, dtype):
    """{backend: {fwd, fwd_bwd, saved}} at one length. The backends take turns within each repeat,
    so that a burst of load from elsewhere on the machine hits them alike; the fastest repeat
    counts (noise only ever adds time)."""
    calls = {backend: make_calls(backend, seq_len, args, device, dtype) for backend in backends}
    result = {}
    for backend, (forward, forward_backward) in calls.items():
        with measure_saved_bytes() as saved:
            forward()
        forward_backward()  # warm-up
        synchronize(device)
        result[backend] = dict(fwd=float("inf"), fwd_bwd=float("inf"), saved=saved.activations)
    for _ in range(args.repeats):
        for backend, (forward, forward_backward) in calls.items():
            result[backend]["fwd"] = min(result[backend]["fwd"], timed(forward, device))
            result[backend]["fwd_bwd"] = min(result[backend]["fwd_bwd"], timed(forward_backward, device))
    return result


def attention_flops(seq_len, args):
    forward = 4 * args.batch * args.heads * seq_len * seq_len * args.head_dim / 2  # causal: half
    return forward, forward * 3.5


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    naive_max_len = args.naive_max_len or (8192 if device.type == "cuda" else 2048)
    backends = ["sdpa", "naive", "flash_torch"]
    if device.type == "cuda" and flash_triton.unavailable_reason(device) is None:
        backends.append("flash_triton")
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# attention, causal, batch {args.batch}, heads {args.heads}/{args.kv_heads} kv, head_dim "
          f"{args.head_dim}, {str(dtype).removeprefix('torch.')}, {machine}, torch {torch.__version__}, "
          f"best of {args.repeats}")

    # One throw-away round: first calls pay for thread pools, allocator growth, kernel compiles.
    measure_length(backends, args.lengths[0], args, device, dtype)
    results = {}  # (backend, seq_len) -> dict
    for seq_len in args.lengths:
        present = [b for b in backends if b != "naive" or seq_len <= naive_max_len]
        for backend, result in measure_length(present, seq_len, args, device, dtype).items():
            results[backend, seq_len] = result
        print(f"  T={seq_len:5d} done", file=sys.stderr, flush=True)

    rate_unit, rate_scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    print(f"\n| T | backend | fwd ms | fwd+bwd ms | saved MiB | fwd / sdpa | fwd+bwd / sdpa | saved / sdpa "
          f"| fwd+bwd {rate_unit} |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for (backend, seq_len), r in results.items():
        base = results["sdpa", seq_len]
        flops_fwd, flops_bwd = attention_flops(seq_len, args)
        print(f"| {seq_len} | {backend} | {r['fwd'] * 1e3:.2f} | {r['fwd_bwd'] * 1e3:.2f} | "
              f"{r['saved'] / 2**20:.2f} | {r['fwd'] / base['fwd']:.2f} | {r['fwd_bwd'] / base['fwd_bwd']:.2f} | "
              f"{r['saved'] / base['saved']:.2f} | {(flops_fwd + flops_bwd) / r['fwd_bwd'] / rate_scale:.2f} |")
    plot(results, backends, args, machine)


# Each backend its own marker and dash, sdpa wide and pale underneath: lines that coincide (sdpa
# and flash_torch save about the same bytes) stay visible on top of each other.
STYLES = {"naive": dict(marker="s", linestyle="-", linewidth=1.5, markersize=6),
          "sdpa": dict(marker="o", linestyle="-", linewidth=5.0, markersize=11, alpha=0.45),
          "flash_torch": dict(marker="^", linestyle="--", linewidth=1.8, markersize=6),
          "flash_triton": dict(marker="x", linestyle=":", linewidth=1.8, markersize=8)}


def plot(results, backends, args, machine):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 1024 and 0.5, not 2^10 and 5x10^-1
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in backends:
        lengths = [t for t in args.lengths if (backend, t) in results]
        ax_time.plot(lengths, [results[backend, t]["fwd_bwd"] * 1e3 for t in lengths], label=backend,
                     **STYLES[backend])
        ax_mem.plot(lengths, [results[backend, t]["saved"] / 2**20 for t in lengths], label=backend,
                    **STYLES[backend])
    for ax, label in ((ax_time, "forward+backward time (ms)"), (ax_mem, "saved for backward (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(args.lengths)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"causal attention, {args.heads} heads x d {args.head_dim}, batch {args.batch}: {machine}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
