import json
import subprocess
import sys

import pytest

from lmforge.cli.training import retain_freed_memory

# A training step's pattern of host allocations (float32 elements per block, argv[2]), all touched,
# then all freed, round after round. Prints minor page faults per round and the number of 4 KiB
# pages allocated per round. Transparent huge pages are turned off for the process: where the
# kernel has them on, a fresh block of 64 MiB may fault in 2 MiB at a time, which hides from the
# count the zeroing that a fresh mapping costs all the same.
ROUNDS = """
import ctypes, json, resource, sys
import numpy as np
PR_SET_THP_DISABLE = 41
assert ctypes.CDLL(None).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
if sys.argv[1] == "retain":
    from lmforge.cli.training import retain_freed_memory
    assert retain_freed_memory()
sizes = json.loads(sys.argv[2])
def one_round():
    buffers = []
    for n in sizes:
        buffers.append(np.empty(n, dtype=np.float32))
        buffers[-1].fill(1.0)
one_round()  # first touch, not counted
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5, sum(sizes) * 4 / 4096)
"""


# many mid-sized activations and a few blocks of 32 MiB (the default config's logits)
DEFAULT_STEP = [3 * 2**20] * 20 + [2**19] * 40 + [8 * 2**20 + 16] * 3
# GPT-2's vocabulary at 1024 tokens: blocks of 154-206 MB (logits, their gradient, the embedding's
# gradient), above the largest mmap threshold glibc accepts (32 MiB), and more of them than the
# heap's top pad (512 MiB) holds
GPT2_STEP = [2**19] * 10 + [2**25 + 16] * 6


def faults_per_round(mode: str, sizes: list[int]) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode, json.dumps(sizes)], check=True, capture_output=True,
                         text=True)
    faults, pages = map(float, out.stdout.split())
    return faults, pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
@pytest.mark.parametrize("sizes", [DEFAULT_STEP, GPT2_STEP], ids=["default", "gpt2"])
def test_freed_memory_is_not_faulted_in_again(sizes):
    if not retain_freed_memory():
        pytest.skip("malloc is not glibc's")
    default, pages = faults_per_round("default", sizes)
    retained, _ = faults_per_round("retain", sizes)
    assert default > 0.1 * pages  # glibc's defaults: a large share is unmapped and faulted in again
    assert retained < 0.01 * pages
