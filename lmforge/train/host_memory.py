"""Keep freed host memory mapped in the process (Linux, glibc), so training steps stop re-faulting it.

PyTorch's CPU tensors come from malloc. glibc serves large blocks with fresh mmap() calls, unmaps
them when they are freed, and trims the top of its heap; a training step frees and re-allocates the
same large activations every step, so the kernel maps and zeroes those pages again, one fault per
4 KiB page. On the default config that is 39-43k minor page faults and ~70 ms of kernel time per
0.5 s step. Raising the mmap threshold to its maximum (32 MiB), growing the heap in large steps
(M_TOP_PAD) and never trimming it keeps most of the pages: 14.6-19.5k faults per step and 4-5%
faster steps (`bench/throughput.py` prints faults per step with and without this; two runs in
bench/RESULTS.md).

The cost is that the process keeps its peak memory until it exits, as a training process does anyway.
"""

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # from glibc's <malloc.h>
SETTINGS = {M_MMAP_THRESHOLD: 32 * 2**20, M_TOP_PAD: 512 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1}


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
