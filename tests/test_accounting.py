"""Dtypes, hardware peaks, MFU, `lmforge plan` and the trainer's predicted-vs-measured report."""

import json
import subprocess
import sys

import pytest
import torch

from lmforge.accounting.dtypes import DTYPES, dtype_info
from lmforge.accounting.hardware import ACCELERATORS, accelerator_peak, mfu
from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.common.errors import LmforgeError
from lmforge.cli import main
from lmforge.config import make_config

# (exponent bits, mantissa bits, max) from the IEEE 754 and Micikevicius et al. 2022 tables
KNOWN_FORMATS = {"float32": (8, 23, 3.4028234663852886e38), "float16": (5, 10, 65504.0),
                 "bfloat16": (8, 7, 3.3895313892515355e38), "float8_e4m3fn": (4, 3, 448.0),
                 "float8_e5m2": (5, 2, 57344.0)}


@pytest.mark.parametrize("name", DTYPES)
def test_dtype_table_agrees_with_finfo_and_the_format_definitions(name):
    info, finfo = dtype_info(name), torch.finfo(DTYPES[name])
    assert (info.bits, info.max, info.smallest_normal, info.eps) == (finfo.bits, finfo.max, finfo.smallest_normal,
                                                                     finfo.eps)
    assert (info.exponent_bits, info.mantissa_bits, info.max) == KNOWN_FORMATS[name]
    assert info.bytes * 8 == info.bits == 1 + info.exponent_bits + info.mantissa_bits
    assert torch.empty(3, dtype=DTYPES[name]).nbytes == 3 * info.bytes
    # eps is the gap above 1.0: 1 + eps is representable, 1 + eps/2 rounds back to 1
    one = torch.tensor(1.0, dtype=torch.float64)
    assert (one + info.eps).to(DTYPES[name]).double().item() == 1 + info.eps
    assert (one + info.eps / 4).to(DTYPES[name]).double().item() == 1.0


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'float4'"):
        dtype_info("float4")


def test_datasheet_peaks_and_mfu():
    assert accelerator_peak("h100-sxm", "bfloat16") == 989.4e12
    assert accelerator_peak("a100", "bfloat16") == 312e12
    for accelerator in ACCELERATORS.values():  # tensor-core formats are at least as fast as fp32
        assert accelerator.peak_flops["bfloat16"] >= accelerator.peak_flops["float32"]
        bf16 = accelerator.peak_flops["bfloat16"]
        assert accelerator.peak_flops.get("float8", bf16) >= bf16
    with pytest.raises(ValueError, match="a100 has no float8"):
        accelerator_peak("a100", "float8")
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        accelerator_peak("tpu", "bfloat16")
    # PaLM 540B, Chowdhery et al. 2022 table 3: 238.3k tokens/s on 6144 TPU v4 chips (275 TFLOP/s
    # bf16 each), 6N + 12LHQT = 2.0e12*... here simply: MFU is achieved over peak FLOP/s
    assert mfu(1000.0, 1e9, 4e12) == 0.25


def test_plan_for_the_default_model_adds_up():
    cfg = make_config(overrides=["train.batch_size=8", "train.seq_len=256"])
    plan = make_plan(cfg, Costing(hardware="h100-sxm", mfu=0.5, tokens=1e9))
    mem = plan["memory"]
    assert mem["per_device_bytes"] == sum(mem["breakdown_bytes"].values())
    assert mem["fits"]
    t = plan["time"]
    assert t["seconds_per_step"] == pytest.approx(plan["flops"]["training_per_step"] / (67e12 * 0.5))
    assert t["seconds_for_tokens"] == pytest.approx(1e9 / 2048 * t["seconds_per_step"])


def test_plan_sharding_and_recompute_shrink_memory():
    setup = ["train.batch_size=1", "train.seq_len=8192", "train.precision=bf16-mixed"]
    base = make_plan(make_config("llama3-70b", overrides=setup), Costing(hardware="h100-sxm"))
    sharded = make_plan(make_config("llama3-70b", overrides=[*setup, "train.parallel=zero3", "train.recompute=full"]),
                        Costing(hardware="h100-sxm", dp=64))
    assert not base["memory"]["fits"] and sharded["memory"]["fits"]
    states = [plan["memory"]["breakdown_bytes"]["optimizer_states"] for plan in (sharded, base)]
    assert states[0] * 64 == states[1]


@pytest.mark.parametrize("overrides, changes, message", [
    (["train.precision=int8"], {}, "train.precision must be one of"),  # config validation, as `lmforge train`'s
    ([], dict(hardware="tpu-v9"), "unknown hardware 'tpu-v9'"),
    ([], dict(mfu=1.5), "mfu must be in (0, 1]"),
    (["train.batch_size=0"], {}, "train.batch_size must be positive, got 0"),
])
def test_plan_refuses_bad_setups(overrides, changes, message):
    with pytest.raises(LmforgeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_plan(make_config("tiny", overrides=overrides), Costing(**{"hardware": "a100", **changes}))


@pytest.mark.parametrize("args, message", [
    (["--zero-stage", "4"], "zero stage must be 0, 1, 2 or 3"),
    (["--precision", "int8"], "train.precision must be one of"),
    (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
])
def test_plan_command_refuses_bad_setups_in_one_line(args, message, capsys):
    assert main(["plan", "--model", "tiny", "--hardware", "a100", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_gpt3_175b_example_from_the_command_line(capsys):
    code = main(["plan", "--model", "gpt3-175b", "--batch-size", "128", "--seq-len", "2048", "--precision", "fp16",
                 "--recompute", "none", "--json", "--hardware", "a100"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["memory"]["activations_korthikanti_bytes"] == 35_253_091_565_568
    assert round(plan["memory"]["activations_to_16bit_parameters_ratio"]) == 101
    assert plan["setup"]["precision"] == "fp16-mixed"


@pytest.mark.parametrize("preset", ["tiny", "llama3-1b", "llama3-70b"])
def test_plan_command_table_and_plot(preset, tmp_path, capsys):
    png = tmp_path / "memory.png"
    assert main(["plan", "--model", preset, "--hardware", "h100-sxm", "--precision", "bf16-mixed",
                 "--tokens", "1e9", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for phrase in ("memory per device", "optimizer states", "time per step", "time for 1.00 G tokens"):
        assert phrase in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_on_this_machine_and_dtypes(capsys):
    assert main(["plan", "--model", "tiny", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["time"]["hardware"].startswith("this machine") and plan["time"]["peak_flops_per_device"] > 1e9
    assert main(["plan", "--dtypes"]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn" in out and "448" in out


def test_plan_command_bad_input_is_one_line(capsys):
    assert main(["plan", "--model", "tiny", "--zero-stage", "5", "--hardware", "a100"]) == 2
    assert capsys.readouterr().err.strip() == "lmforge: error: zero stage must be 0, 1, 2 or 3, got 5"


def test_trainer_reports_predicted_beside_measured(tiny_config, tmp_path):
    from lmforge.train.loop import Trainer

    cfg = tiny_config(max_steps=4, eval_interval=4, checkpoint_interval=4, recompute="selective")
    summary = Trainer(cfg, tmp_path / "run", progress=False).run()
    rows = summary["predicted_vs_measured"]
    for key in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes"):
        assert rows[key]["measured"] == rows[key]["predicted"]
    assert rows["activations_bytes"]["measured"] == pytest.approx(rows["activations_bytes"]["predicted"], rel=0.05)
    assert 0 < rows["mfu"]["measured"] < rows["hfu"]["measured"] < 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("hfu" in r and "mfu" in r for r in records if "train_loss" in r)


def test_flop_counting_leaves_torchs_global_registry_alone():
    from torch.utils import flop_counter

    from tests.test_flops import count_flops
    from lmforge.model.transformer import Transformer

    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert fused not in flop_counter.flop_registry
    cfg = make_config("tiny")
    model = Transformer(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 32))
    with_attention = count_flops(lambda: model(tokens))
    assert fused not in flop_counter.flop_registry
    # the fused op was counted (by the formula given to that counter alone): 4*T*d_head*heads per
    # token and layer for QK^T and AV over the full T x T matrix
    plain = flop_counter.FlopCounterMode(display=False)
    with plain:
        model(tokens)
    assert with_attention - plain.get_total_flops() == cfg.model.n_layers * 4 * 32 * 32 * cfg.model.d_model


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2-124m"])
def test_shapes_read_on_the_meta_device_are_the_real_models(preset):
    """Parameters and linear-layer weights read from the meta build equal the real model's."""
    from lmforge.accounting.shapes import model_shapes
    from lmforge.model.transformer import Transformer

    cfg = make_config(preset).model
    real = Transformer(cfg)  # on the CPU, initialised
    shapes = model_shapes(cfg)
    assert shapes.parameters == sum(p.numel() for p in dict.fromkeys(real.parameters()))
    assert shapes.matmul_weights == sum(m.weight.numel() for m in real.modules() if isinstance(m, torch.nn.Linear))


def test_a_70b_plan_reads_a_model_that_holds_no_memory():
    from lmforge.accounting.shapes import model_shapes
    from lmforge.model.transformer import meta_model

    cfg = make_config("llama3-70b").model
    model = meta_model(cfg)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # shapes only: nothing allocated
    assert model_shapes(cfg).parameters == 70_553_706_496
    plan = make_plan(make_config("llama3-70b", overrides=["train.batch_size=1", "train.seq_len=8192"]),
                     Costing(hardware="h100-sxm"))
    assert plan["model"]["parameters"] == 70_553_706_496
    # nor does it initialise anything: the meta kernels of random fills would load torch._dynamo
    # (seconds, against ~0.1 s for the whole plan), so a fresh process plans without it
    code = ("import sys; from lmforge.accounting.plan.make import Costing, make_plan; "
            "from lmforge.config import make_config; "
            "make_plan(make_config('llama3-70b', overrides=['train.seq_len=256']), Costing(hardware='h100-sxm')); "
            "print('dynamo loaded:', 'torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "dynamo loaded: False"


@pytest.mark.parametrize("preset", ["small", "llama2-7b"])
def test_six_n_is_six_times_the_n_the_plan_prints(preset, capsys):
    """The 6N beside the per-component count is 6 x the N printed with it, and the row says which
    parameters N leaves out (it is not the parameter count printed above it)."""
    from lmforge.common.errors import human_count

    assert main(["plan", "--model", preset, "--hardware", "a100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    n = plan["model"]["matmul_parameters"]
    assert plan["flops"]["six_n_per_token"] == 6 * n
    weights = ("qkv_projections", "output_projection", "mlp", "lm_head")  # 2 forward FLOPs per weight
    assert sum(plan["flops"]["forward_per_token_by_component"][k] for k in weights) == 2 * n
    assert main(["plan", "--model", preset, "--hardware", "a100"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the table's cells unwrapped
    assert (f"6N {human_count(6 * n)}, N = {human_count(n)} matmul weights (norms, biases, embedding lookups "
            f"left out)") in out


def test_a_linear_layer_accounting_does_not_know_is_refused(monkeypatch):
    """A new linear layer must be given its FLOP component, not be silently counted somewhere."""
    import dataclasses

    from lmforge.accounting import shapes
    from lmforge.model import transformer

    class WiderGelu(transformer.GeluMLP):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.extra_proj = torch.nn.Linear(cfg.d_model, cfg.d_model)

    monkeypatch.setitem(transformer.FAMILIES, "gpt", dataclasses.replace(transformer.FAMILIES["gpt"], mlp=WiderGelu))
    cfg = make_config("tiny", overrides=["model.family=gpt", "model.n_kv_heads=null", "model.d_model=72"]).model
    try:
        with pytest.raises(ValueError, match="no FLOP component for the linear layer blocks.0.mlp.extra_proj"):
            shapes.model_shapes(cfg)
    finally:
        shapes._shapes.cache_clear()
