"""The `dist` marker's suite is never empty (CI runs `pytest -m dist`, which fails on no tests):
a real two-process gloo all-reduce, launched as users launch: torchrun."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_gloo_all_reduce(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import datetime, torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        print(f"rank {dist.get_rank()} sum {x.item():g}")
        dist.destroy_process_group()
    """))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", str(script)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "rank 0 sum 3" in result.stdout and "rank 1 sum 3" in result.stdout
