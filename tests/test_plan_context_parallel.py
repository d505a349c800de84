"""`lmforge plan --cp N` (accounting/cp.py): the plan of a context-parallel setup,
in one process. That its figures equal what cp ranks really save, hold and send is checked under
torchrun in tests/test_cp_accounting_dist.py; here: what the command prints and refuses, and that
its parts are the formulas they say they are."""

import json

import pytest

from lmforge.accounting.cp import context_parallel_bytes, ring_activation_breakdown
from lmforge.accounting.activations import activation_breakdown
from lmforge.cli import main
from lmforge.config import make_config

TINY = ["plan", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--hardware", "h100-sxm", "--json"]


def plan_json(capsys, *extra: str) -> dict:
    assert main([*TINY, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cp_plan_counts_each_rank_at_its_shard(capsys):
    one, cp2 = plan_json(capsys), plan_json(capsys, "--cp", "2", "--grad-accum", "2")
    cfg = make_config("tiny").model
    section = cp2["context_parallel"]
    assert (section["tokens_per_rank_per_sequence"], section["chunks"], section["chunk_tokens"]) == (32, 4, 16)
    assert cp2["setup"]["devices"] == 2 and cp2["setup"]["tokens_per_step"] == 2 * one["setup"]["tokens_per_step"]
    assert section["training_flops_per_rank_per_step"] == cp2["flops"]["training_per_step"] / 2
    ring = context_parallel_bytes(cfg, 4, 64, 2, 4)
    assert cp2["communication"]["context_parallel"]["sent_bytes"] == 2 * (ring["forward"] + ring["backward"])
    # the same model states (every cp rank holds the whole model); DDP's all-reduce over the 2 cp ranks
    assert {k: cp2["memory"]["breakdown_bytes"][k] for k in ("parameters", "gradients", "optimizer_states")} == \
           {k: one["memory"]["breakdown_bytes"][k] for k in ("parameters", "gradients", "optimizer_states")}
    assert cp2["communication"]["strategy"] == "ddp" and one["communication"]["sent_bytes"] == 0
    saved = ring_activation_breakdown(cfg, 4, 64, 2)
    assert cp2["memory"]["breakdown_bytes"]["weight_copies"] == saved.pop("weight_copies")  # fp32: none
    assert cp2["memory"]["activation_breakdown_bytes"] == saved


def test_cp1_is_the_plan_without_cp(capsys):
    assert plan_json(capsys, "--cp", "1") == plan_json(capsys)


def test_ring_breakdown_is_the_shards_layers_plus_what_the_ring_does_differently():
    """The per-part differences from one process at n tokens are the three the docstring names."""
    cfg = make_config("tiny").model
    ring, plain = ring_activation_breakdown(cfg, 4, 64, 2), activation_breakdown(cfg, 4, 32)
    assert ring["layers"] - plain["layers"] == cfg.n_layers * 4 * 32 * cfg.n_heads * cfg.head_dim * 4
    assert ring["rope_tables"] == 2 * 32 * cfg.head_dim * 4 < plain["rope_tables"]
    assert ring["head_and_loss"] - plain["head_and_loss"] == 8
    assert ring["embedding"] == plain["embedding"]


def test_tp_times_cp_turns_sequence_parallelism_off(capsys):
    plan = plan_json(capsys, "--cp", "2", "--tp", "2")
    assert plan["setup"]["sequence_parallel"] is False and plan["setup"]["devices"] == 4
    assert "tensor_parallel" in plan["communication"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_the_model_states_over_dp_times_cp(capsys, stage):
    """Each cp rank is one more replica to ZeRO (parallel/engine.py): on dp 2 x cp 2 its states
    are those of ZeRO over 4 replicas without cp (measured == in tests/test_cp_zero_dist.py)."""
    keys = ("parameters", "gradients", "master_weights", "optimizer_states")
    cp = plan_json(capsys, "--cp", "2", "--dp", "2", "--zero-stage", str(stage))
    dp4 = plan_json(capsys, "--dp", "4", "--zero-stage", str(stage))
    states = [{k: plan["memory"]["breakdown_bytes"][k] for k in keys} for plan in (cp, dp4)]
    assert states[0] == states[1]
    assert cp["communication"]["strategy"] == f"zero{stage}" and cp["communication"]["ranks"] == 4
    assert cp["communication"]["sent_bytes"] == dp4["communication"]["sent_bytes"]


@pytest.mark.parametrize("extra, message", [
    (["--pp", "2"], "parallel.cp=2 does not combine with parallel.pp: pipelines of context-parallel"),
    (["--seq-len", "3"], "parallel.cp=2 cuts train.seq_len=3 into 2 x cp = 4 chunks"),
    (["model.dropout=0.1"], "parallel.cp=2 does not combine with model.dropout"),
])
def test_what_the_trainer_refuses_the_plan_refuses(capsys, extra, message):
    assert main([*TINY, "--cp", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_plan_of_a_config_with_parallel_cp_is_the_cp_plan(capsys):
    """The trainer's plan comes from its config: parallel.cp=2 is --cp 2."""
    assert plan_json(capsys, "parallel.cp=2") == plan_json(capsys, "--cp", "2")


def test_cp_is_a_training_setting(capsys):
    assert main(["plan", "--model", "tiny", "--inference", "--cp", "2", "--hardware", "h100-sxm"]) == 2
    assert "--cp is a training setting" in capsys.readouterr().err
