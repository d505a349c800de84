"""Replicated KV heads (lmforge/parallel/tp.py): tensor parallelism over more ranks than the model has
KV heads, each KV head held by tp / n_kv_heads ranks (Megatron-LM's grouped-query split), trained
against one process on the same global batch (tests/tp_worker.py's steps, fp32, real torchrun).

    tiny (4 heads, 2 KV heads) at tp=4 on 4 ranks:   2 copies of each KV head
    tiny with one KV head (multi-query) at tp=2:      both ranks hold the one KV head
    the same as 2 ddp replicas on 4 ranks
    the same with sequence parallelism
    the same with LoRA on k and v too (a replicated head's B is replicated with it)

Tolerances: tests/test_tp_dist.py's (float rounding of the summation order; losses and norms 1e-5
relative, gradients 2e-6 absolute). A copy's gradient left unsummed is the gradient of half the
query heads, off by the gradient's own size; a norm that counted each copy twice is off by far
more than 1e-5.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import run_worker as run_cells  # noqa: E402
from test_tp_compose_dist import LORA, WORKER, assert_trains_as_one_process  # noqa: E402
from test_tp_compose_dist import one_process as one_process_cell  # noqa: E402
from test_tp_dist import assert_same_training, one_process, run_worker  # noqa: E402

from lmforge.config import make_config  # noqa: E402
from lmforge.modes import get_policy  # noqa: E402
from lmforge.train.setup import build_engine  # noqa: E402

pytestmark = pytest.mark.dist

LR = make_config("tiny").optim.lr


def assert_whole_state(result: dict, reference: dict, extra=()):
    """The checkpoint's view: each KV head once (one process's shapes), loaded back bit for bit."""
    assert {k: v.shape for k, v in result["model"].items()} == {k: v.shape for k, v in reference["model"].items()}
    assert result["num_params"] == build_engine(make_config("tiny", overrides=list(extra)),
                                                get_policy("fp32")).num_params()
    model, optimizer = result["reloaded"]
    assert all(torch.equal(model[name], t) for name, t in result["model"].items())
    for name, entry in result["optimizer"]["state"].items():
        for key, t in entry.items():
            assert torch.equal(optimizer["state"][name][key], t), (name, key)


def test_tp4_with_2_kv_heads_trains_as_one_process(tmp_path):
    result = run_worker(tmp_path, 4, 4, "train")["train"]
    reference = one_process(replicas=1)
    assert_same_training(result, reference, lr=LR)
    assert_whole_state(result, reference)


@pytest.mark.parametrize("extra", [["model.n_kv_heads=1"], ["model.n_kv_heads=1", "parallel.sequence_parallel=true"]],
                         ids=["mqa", "mqa+sp"])
def test_tp2_with_one_kv_head_trains_as_one_process(tmp_path, extra):
    result = run_worker(tmp_path, 2, 2, "train", extra)["train"]
    reference = one_process(replicas=1, extra=[e for e in extra if not e.startswith("parallel.")])
    assert_same_training(result, reference, lr=LR)
    assert_whole_state(result, reference, [e for e in extra if not e.startswith("parallel.")])


def test_tp2_times_ddp2_with_one_kv_head_trains_as_one_process(tmp_path):
    """4 ranks: 2 ddp replicas of 2 tensor ranks, both holding the one KV head: the copies' sum
    (tp group) and the replicas' average (dp group) each once."""
    result = run_worker(tmp_path, 4, 2, "train", ["model.n_kv_heads=1"])["train"]
    reference = one_process(replicas=2, extra=["model.n_kv_heads=1"])
    assert_same_training(result, reference, lr=LR)
    assert_whole_state(result, reference, ["model.n_kv_heads=1"])


def test_lora_on_a_replicated_kv_head_trains_as_one_process(tmp_path):
    """tests/test_tp_compose_dist.py's LoRA cell (its tolerances), with one KV head at tp=2 and
    adapters on k_proj and v_proj as well: their B slices are the replicated head's."""
    cell = [*LORA, "finetune.lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj", "model.n_kv_heads=1"]
    result = run_cells(tmp_path, 2, {"LoRA mqa": cell}, WORKER)["LoRA mqa"]
    assert {"blocks.0.attn.k_proj.lora_B", "blocks.0.attn.v_proj.lora_B"} <= set(result["grads"])
    assert_trains_as_one_process("LoRA mqa", result, one_process_cell(1, cell))
