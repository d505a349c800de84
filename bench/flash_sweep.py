"""Launch settings of the Triton FlashAttention kernels, swept on a GPU: block sizes, warps and
pipeline stages for each of the three kernels (forward, backward dK/dV, backward dQ) on one shape.

    PYTHONPATH=. python3 bench/flash_sweep.py [--out DIR]      # CUDA only

The backward kernels read only the saved log-sum-exp and rowsum(dO * O) per row, so their blocks
need not match the forward's: each kernel gets its own best setting. Prints one table per kernel,
fastest first, and SDPA's flash backend (forward, and forward + backward) on the same shape as the
yardstick; writes DIR/flash_sweep.json.
"""

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmforge.kernels import flash_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--shape", default="4,16,4096,128", help="batch,heads,seq,head_dim (bf16, causal)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flash_sweep: needs a CUDA GPU")
    import triton.testing

    started = time.perf_counter()
    batch, heads, seq, d = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda")
    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch, heads, seq, d, device=device, dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    kernels = flash_triton._kernels()
    flops_forward = 4 * batch * heads * seq * seq * d / 2  # causal: half the score matrix

    # the forward's outputs, for the backward kernels' inputs (any correct lse and delta will do)
    out = torch.empty(batch, seq, heads, d, dtype=q.dtype, device=device).transpose(1, 2)
    lse = torch.empty(batch, heads, seq, dtype=torch.float32, device=device)
    base = dict(CAUSAL=True, UPCAST_TILES=False, DOT_PRECISION="tf32", BLOCK_D=flash_triton._head_block(d))
    shape_args = (scale, heads, heads, seq, seq, d)
    kernels.flash_forward_kernel[(triton.cdiv(seq, 64), batch * heads)](q, k, v, out, lse, *shape_args, BLOCK_M=64,
                                                                         BLOCK_N=64, **base)
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def launch(kernel: str, bm: int, bn: int, warps: int, stages: int):
        settings = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        if kernel == "forward":
            return lambda: kernels.flash_forward_kernel[(triton.cdiv(seq, bm), batch * heads)](
                q, k, v, out, lse, *shape_args, **settings)
        if kernel == "dkdv":
            return lambda: kernels.flash_backward_dkdv_kernel[(triton.cdiv(seq, bn), batch * heads)](
                q, k, v, grad_out, lse, delta, grad_k, grad_v, *shape_args, **settings)
        return lambda: kernels.flash_backward_dq_kernel[(triton.cdiv(seq, bm), batch * heads)](
            q, k, v, grad_out, lse, delta, grad_q, *shape_args, **settings)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_forward = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        sdpa_both = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad_out))
    results = {"shape": args.shape, "sdpa_flash_forward_ms": sdpa_forward, "sdpa_flash_fwd_bwd_ms": sdpa_both,
               "gpu": torch.cuda.get_device_name(), "kernels": {}}
    print(f"SDPA flash: forward {sdpa_forward:.3f} ms ({flops_forward / sdpa_forward / 1e9:.0f} TFLOP/s), "
          f"forward+backward {sdpa_both:.3f} ms", flush=True)
    configs = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 1)))
    per_kernel_budget = args.budget / 3
    for kernel in ("forward", "dkdv", "dq"):
        rows, kernel_started = [], time.perf_counter()
        for bm, bn, warps, stages in configs:
            if time.perf_counter() - kernel_started > per_kernel_budget:
                rows.append({"note": "budget spent: the remaining settings were not tried"})
                break
            try:
                ms = triton.testing.do_bench(launch(kernel, bm, bn, warps, stages), warmup=10, rep=40)
                rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "ms": ms})
            except Exception as err:  # no room in shared memory for this setting, and the like
                rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                             "error": str(err).splitlines()[0][:120]})
        timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        results["kernels"][kernel] = rows
        print(f"\n{kernel}: {len(timed)} settings ran, {sum('error' in r for r in rows)} failed; fastest first", flush=True)
        for r in timed[:6]:
            print(f"  BLOCK_M {r['block_m']:>3} BLOCK_N {r['block_n']:>3} warps {r['warps']} stages {r['stages']}: "
                  f"{r['ms']:.3f} ms", flush=True)
        default = next((r for r in timed if (r["block_m"], r["block_n"], r["warps"], r["stages"]) == (64, 64, 4, 3)), None)
        if default:
            print(f"  (today's default 64x64, 4 warps, 3 stages: {default['ms']:.3f} ms)", flush=True)
    best = {kernel: min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
            for kernel, rows in results["kernels"].items()}
    total = sum(b["ms"] for b in best.values())
    print(f"\nbest of each kernel together: {total:.3f} ms vs SDPA flash forward+backward {sdpa_both:.3f} ms "
          f"({sdpa_both / total:.2f}x; the backward's rowsum(dO*O) not included); {time.perf_counter() - started:.0f} s",
          flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "flash_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
