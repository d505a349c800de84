"""Keep freed host memory mapped in the process (Linux, glibc), so training steps stop re-faulting it.

PyTorch's CPU tensors come from malloc. glibc serves large blocks with fresh mmap() calls, unmaps
them when they are freed, and trims the top of its heap; a training step frees and re-allocates the
same large activations every step, so the kernel maps and zeroes those pages again, one fault per
4 KiB page. On the default config that is 39-43k minor page faults and ~70 ms of kernel time per
0.5 s step. Serving every block from the heap (M_MMAP_MAX = 0: no block gets an mmap of its own,
whatever its size), growing the heap in large steps (M_TOP_PAD) and never trimming it keeps the
pages (`bench/throughput.py` prints faults per step; bench/RESULTS.md). This first raised the
mmap threshold to its ceiling, 32 MiB, instead: 14-19k faults per step on the default config and
4-5% faster steps than glibc's defaults, but blocks above 32 MiB still got an mmap of their own
whenever the heap's free space ran short, and at GPT-2's vocabulary the logits (1024 x 50257
fp32: 206 MB), their gradient and the embedding's (154 MB) are such blocks. With M_MMAP_MAX = 0,
measured beside the threshold alone: 1.3k instead of 14k faults per step and 1.05x on the default
config, 61k instead of 359k and 1.11x on a 4-layer GPT-2 shape (bench/RESULTS.md, issue 15).

The cost is that the process keeps its peak memory until it exits, as a training process does
anyway, plus what fragments of the heap cannot be reused for the next step's large blocks: on
the 4-layer GPT-2 shape above the peak resident memory rose from 2.3 to 3.1 GB (the default
config's did not move).
"""

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # from glibc's <malloc.h>
SETTINGS = {M_MMAP_MAX: 0, M_TOP_PAD: 512 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1}


def retain_freed_memory() -> bool:
    """Apply the settings above; False (and nothing changed) where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # present in glibc only (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(option, value) == 1 for option, value in SETTINGS.items())
