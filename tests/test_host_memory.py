import subprocess
import sys

import pytest

from lmforge.train.host_memory import retain_freed_memory

# A training step's pattern of host allocations: many mid-sized activations and a few blocks of
# 32 MiB (the logits), all touched, then all freed, round after round. Prints minor page faults
# per round and the number of 4 KiB pages allocated per round.
ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "retain":
    from lmforge.train.host_memory import retain_freed_memory
    assert retain_freed_memory()
sizes = [3 * 2**20] * 20 + [2**19] * 40 + [8 * 2**20 + 16] * 3  # float32 elements
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


def faults_per_round(mode: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], check=True, capture_output=True, text=True)
    faults, pages = map(float, out.stdout.split())
    return faults, pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_memory_is_not_faulted_in_again():
    if not retain_freed_memory():
        pytest.skip("malloc is not glibc's")
    default, pages = faults_per_round("default")
    retained, _ = faults_per_round("retain")
    assert default > 0.1 * pages  # glibc's defaults: a large share is unmapped and faulted in again
    assert retained < 0.01 * pages
