"""`lmforge plan --inference`: KV cache, weights, decode bandwidth arithmetic, the largest batch."""

import json

import pytest
import torch

from lmforge.accounting.hardware import ACCELERATORS
from lmforge.accounting.plan.inference import InferenceSetup, make_inference_plan
from lmforge.accounting.shapes import model_shapes
from lmforge.cli import main
from lmforge.config import make_config
from lmforge.generate import sampling
from lmforge.model.transformer import Transformer


def llama3_8b_plan(**changes):
    setup = InferenceSetup(**{"batch_size": 1, "seq_len": 8192, "hardware": "h100-sxm", **changes})
    return make_inference_plan(make_config("llama3-8b").model, setup)


def test_llama3_8b_kv_cache_at_8k_is_2_layers_kv_heads_head_dim_2_bytes_per_token():
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads (GQA), head dim 128, bf16
    mem = llama3_8b_plan()["memory"]
    assert mem["kv_cache_per_token_bytes"] == per_token == 131_072
    assert mem["kv_cache_per_sequence_bytes"] == 8192 * per_token == 2**30
    assert llama3_8b_plan(batch_size=4, tp=2)["memory"]["kv_cache_bytes"] == 4 * 8192 * per_token / 2
    assert llama3_8b_plan(kv_dtype="fp8")["memory"]["kv_cache_bytes"] == 8192 * per_token / 2


def test_kv_cache_bytes_are_what_lmforge_generate_allocates(monkeypatch):
    caches = []

    class Recorded(sampling.KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(sampling, "KVCache", Recorded)
    cfg = make_config("tiny").model
    sampling.generate(Transformer(cfg), [1, 2, 3], 4, temperature=0)
    held = caches[0].keys.nbytes + caches[0].values.nbytes  # the prompt and the new tokens, not max_seq_len
    plan = make_inference_plan(cfg, InferenceSetup(seq_len=3 + 4, kv_dtype="fp32", hardware="a100"))
    assert held == caches[0].nbytes == plan["memory"]["kv_cache_bytes"]


def test_weight_bytes_with_per_group_scales():
    cfg, shapes = make_config("llama3-8b").model, model_shapes(make_config("llama3-8b").model)
    block, rest = shapes.block_matmul_weights, shapes.parameters - shapes.block_matmul_weights
    assert sum(llama3_8b_plan(weights="bf16")["memory"]["weights_bytes"].values()) == 2 * shapes.parameters
    int4 = llama3_8b_plan(weights="int4", group_size=64)["memory"]["weights_bytes"]
    assert int4 == {"block_linear": block / 2, "scales": block / 64 * 2, "embedding_head_norms": rest * 2}
    assert cfg.n_layers == 32


def test_decode_step_is_the_bytes_it_reads_over_bandwidth():
    """bf16 Llama-3-8B, one sequence at 8k on an H100 SXM (3.35 TB/s): a step reads every weight
    but the input embedding table (it gathers one row) and the 1 GiB KV cache."""
    n = model_shapes(make_config("llama3-8b").model).parameters
    step_bytes = 2 * n - 2 * 128256 * 4096 + 2**30
    decode = llama3_8b_plan()["decode"]
    assert decode["bytes_per_step"] == step_bytes
    assert decode["seconds_per_step"] == pytest.approx(step_bytes / 3.35e12, rel=1e-12)
    assert decode["bound"] == "memory bandwidth"
    assert decode["tokens_per_second"] == pytest.approx(3.35e12 / step_bytes, rel=1e-12)
    # tp 2 reads half the bytes on each device, in half the time: the same tokens/s per device
    tp2 = llama3_8b_plan(tp=2)["decode"]
    assert tp2["seconds_per_step"] == pytest.approx(decode["seconds_per_step"] / 2, rel=1e-12)
    assert tp2["tokens_per_second_per_device"] == pytest.approx(decode["tokens_per_second"], rel=1e-12)


def test_a_large_batch_at_short_context_is_compute_bound():
    plan = llama3_8b_plan(batch_size=2048, seq_len=16)
    assert plan["decode"]["bound"] == "compute"
    assert plan["decode"]["seconds_per_step"] == pytest.approx(plan["decode"]["flops_per_step"] / 989.4e12)


def test_the_largest_batch_fits_and_one_more_does_not():
    largest = llama3_8b_plan()["memory"]["largest_batch"]
    assert largest == int((ACCELERATORS["h100-sxm"].memory_bytes - 2 * 2**30 - 2 * 8_030_261_248) // 2**30)
    assert llama3_8b_plan(batch_size=largest)["memory"]["fits"]
    assert not llama3_8b_plan(batch_size=largest + 1)["memory"]["fits"]


def test_plan_inference_command(tmp_path, capsys):
    png = tmp_path / "serve.png"
    assert main(["plan", "--inference", "--model", "llama3-8b", "--batch-size", "8", "--seq-len", "8192",
                 "--weights", "int4", "--hardware", "h100-sxm", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for phrase in ("KV cache (8 x 8,192 tokens)", "quantisation scales", "largest batch that fits", "decode tokens/s",
                   "memory bandwidth-bound", "reserve (--reserve"):
        assert phrase in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--inference", "--model", "tiny", "--json", "--weights", "fp32"]) == 0  # this machine
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"]["name"].startswith("this machine") and plan["hardware"]["memory_bandwidth"] > 1e8


@pytest.mark.parametrize("args, message", [
    (["--inference", "--zero-stage", "3"], "--zero-stage is a training setting: leave it out with --inference"),
    (["--weights", "int4"], "--weights is a serving setting: add --inference to use it"),
    (["--inference", "--weights", "int3"], "unknown weight format 'int3'"),
    (["--inference", "--tp", "3"], "tp 3 must divide"),
])
def test_plan_inference_bad_input_is_one_line(args, message, capsys):
    assert main(["plan", "--model", "tiny", "--hardware", "a100", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge: error: ") and message in err and err.count("\n") == 1


def test_the_measured_bandwidth_is_cached_beside_the_peak(tmp_path, monkeypatch):
    from lmforge.accounting import hardware

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_memory_bandwidth", lambda dtype, device: 7e9)
    assert hardware.this_bandwidth("float32", torch.device("cpu")) == 7e9
    monkeypatch.setattr(hardware, "measure_memory_bandwidth", lambda dtype, device: 1.0)
    assert hardware.this_bandwidth("float32", torch.device("cpu")) == 7e9  # from the cache
    assert hardware.this_bandwidth("float32", torch.device("cpu"), remeasure=True) == 1.0
