"""LoRA adapters in PEFT's layout: what lmforge writes, PEFT puts on the exported base and computes
W + (alpha/r) B A with; what PEFT writes, lmforge reads; both round trips bit for bit."""

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.interop.hf import export_hf, import_hf  # noqa: E402
from lmforge.interop.peft import linear_shapes, read_peft_adapter, write_peft_adapter  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402
from test_interop import hf_model, perturbed, tiny_model_config, tokens, tokenizer  # noqa: E402,F401 (a fixture)

RANK, ALPHA = 4, 8
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}


def random_adapter(cfg, targets, seed=0) -> dict[str, torch.Tensor]:
    """A and B for every targeted linear layer, B non-zero (a trained adapter, not a fresh one)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for module, (out_features, in_features) in linear_shapes(cfg).items():
        if module.rsplit(".", 1)[-1] in targets:
            state[f"{module}.lora_A"] = torch.randn(RANK, in_features, generator=gen) * 0.1
            state[f"{module}.lora_B"] = torch.randn(out_features, RANK, generator=gen) * 0.1
    return state


def merged(state: dict, adapter: dict, alpha=ALPHA, rank=RANK) -> dict:
    """W + (alpha / r) B A for each adapted layer: LoRA's definition (Hu et al. 2021, eq. 3)."""
    out = dict(state)
    for name in adapter:
        if name.endswith(".lora_A"):
            module = name.removesuffix(".lora_A")
            out[f"{module}.weight"] = state[f"{module}.weight"] + (alpha / rank) * adapter[f"{module}.lora_B"] @ adapter[name]
    return out


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if torch.is_tensor(out) else out.logits


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_peft_loads_lmforge_adapter_onto_exported_base(family, tokenizer, tmp_path):
    cfg = tiny_model_config(family)
    torch.manual_seed(0)
    base = perturbed(Transformer(cfg)).state_dict()
    adapter = random_adapter(cfg, TARGETS[family])  # gpt: three independent A's, c_attn of rank 3r
    export_hf(cfg, base, tokenizer, tmp_path / "base")
    write_peft_adapter(adapter, cfg, RANK, ALPHA, TARGETS[family], tmp_path / "adapter")
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                                  tmp_path / "adapter").eval()
    ids = tokens()
    ours = Transformer(cfg).eval()
    ours.load_state_dict(merged(base, adapter))
    expected = logits(ours, ids)
    assert (logits(with_adapter, ids) - expected).abs().max().item() < 1e-5
    assert (logits(with_adapter.get_base_model(), ids) - expected).abs().max().item() < 1e-5
    with torch.no_grad():  # and not vacuously: the adapter moves the logits
        plain = Transformer(cfg).eval()
        plain.load_state_dict(base)
        assert (logits(plain, ids) - expected).abs().max().item() > 1e-3

    # PEFT's own merge gives the weights of our merged export
    export_hf(cfg, merged(base, adapter), tokenizer, tmp_path / "merged")
    ours_merged = load_file(tmp_path / "merged" / "model.safetensors")
    theirs_merged = with_adapter.merge_and_unload().state_dict()
    for name, tensor in ours_merged.items():
        assert torch.allclose(theirs_merged[name], tensor, atol=1e-6, rtol=0), name


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_adapter_written_by_peft_reads_into_lmforge_and_back(family, tokenizer, tmp_path):
    hf = hf_model(family, tmp_path / "hf", tokenizer)
    hf_targets = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "gpt": ["c_attn", "c_proj", "c_fc"]}[family]
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=hf_targets,
                                                   fan_in_fan_out=family == "gpt"))
    with torch.no_grad():  # B starts at zero: make it a trained adapter
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora.eval().save_pretrained(tmp_path / "adapter")

    cfg, base, _ = import_hf(tmp_path / "hf")
    adapter, rank, alpha, targets = read_peft_adapter(tmp_path / "adapter", cfg)
    assert (rank, alpha) == (RANK, ALPHA) and targets == sorted(
        f"{'attn' if t in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{t}" for t in TARGETS[family])
    ours = Transformer(cfg).eval()
    ours.load_state_dict(merged(base, adapter))
    ids = tokens()
    assert (logits(ours, ids) - logits(lora, ids)).abs().max().item() < 1e-5

    write_peft_adapter(adapter, cfg, rank, alpha, targets, tmp_path / "again")  # gpt: c_attn's A shared, rank r
    original, again = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_lmforge_adapter_round_trips_bit_for_bit(family, tmp_path):
    cfg = tiny_model_config(family)
    adapter = random_adapter(cfg, TARGETS[family], seed=3)
    write_peft_adapter(adapter, cfg, RANK, 16.0, TARGETS[family], tmp_path / "adapter")
    back, rank, alpha, targets = read_peft_adapter(tmp_path / "adapter", cfg)
    assert (rank, alpha) == (RANK, 16.0)
    assert back.keys() == adapter.keys() and all(torch.equal(back[k], adapter[k]) for k in adapter)


def test_adapter_for_another_base_stops_with_one_line(tmp_path):
    cfg = tiny_model_config("llama")
    write_peft_adapter(random_adapter(cfg, ["q_proj", "v_proj"]), cfg, RANK, ALPHA, ["q_proj", "v_proj"],
                       tmp_path / "adapter")
    wider = tiny_model_config("llama")
    wider.d_model = 128
    shallower = tiny_model_config("llama")
    shallower.n_layers = 1
    cases = [(wider, "another base model"), (shallower, "another base model"),
             (tiny_model_config("gpt"), "no counterpart")]
    for other, words in cases:
        with pytest.raises(LmforgeError) as err:
            read_peft_adapter(tmp_path / "adapter", other)
        assert words in str(err.value) and "\n" not in str(err.value)
    gpt = tiny_model_config("gpt")
    with pytest.raises(LmforgeError, match="together or none"):  # GPT-2's fused c_attn: q without k and v
        write_peft_adapter(random_adapter(gpt, ["q_proj"]), gpt, RANK, ALPHA, ["q_proj"], tmp_path / "partial")
    with pytest.raises(LmforgeError, match="not a PEFT adapter folder"):
        read_peft_adapter(tmp_path, cfg)


def test_lmforge_lora_model_equals_peft_on_the_exported_base(tokenizer, tmp_path):
    """lmforge's own LoRALinear wrappers, holding an adapter, give the logits PEFT computes with
    the same adapter written in its layout onto the exported base."""
    from lmforge.model.lora import apply_lora, load_adapter_state_dict

    cfg = tiny_model_config("llama")
    torch.manual_seed(0)
    base = perturbed(Transformer(cfg)).state_dict()
    targets = TARGETS["llama"]
    adapter = random_adapter(cfg, targets)
    ours = Transformer(cfg)
    ours.load_state_dict(base)
    apply_lora(ours, ",".join(targets), RANK, ALPHA)
    load_adapter_state_dict(ours, adapter)
    export_hf(cfg, base, tokenizer, tmp_path / "base")
    write_peft_adapter(adapter, cfg, RANK, ALPHA, targets, tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                            tmp_path / "adapter").eval()
    ids = tokens()
    assert (logits(ours.eval(), ids) - logits(theirs, ids)).abs().max().item() < 1e-5


def test_finetune_an_hf_folder_with_lora_and_load_the_adapter_in_peft(tokenizer, tmp_path):
    """`lmforge finetune --base <a Hugging Face folder>` trains LoRA adapters in the base's own
    tokenizer; `lmforge export --format peft` writes them so that PEFT, on that same folder,
    computes the logits of lmforge's base + adapter."""
    import json
    import random

    from lmforge.cli import main
    from lmforge.runs.checkpoint.find import find_checkpoint
    from lmforge.runs.load import model_from_checkpoint
    from test_interop import hf_model

    hf_model("llama", tmp_path / "hf", tokenizer)
    rng = random.Random(0)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(32):
            f.write(json.dumps({"prompt": f"import os {rng.randrange(9)}", "response": " class A"}) + "\n")
    status = main(["finetune", "--base", str(tmp_path / "hf"), "--lora-rank", "4", "--lora-alpha", "8",
                   "--no-progress", "--out", str(tmp_path / "ft"), f"data.source={tmp_path / 'pairs.jsonl'}",
                   "train.max_steps=3", "train.batch_size=4", "train.seq_len=16", "train.eval_batches=1",
                   "train.sample_tokens=0", "train.tensorboard=false", "optim.lr=1e-2", "optim.warmup_steps=1"])
    assert status == 0
    assert main(["export", "--format", "peft", str(tmp_path / "ft"), "--out", str(tmp_path / "adapter")]) == 0
    _, ours, _ = model_from_checkpoint(find_checkpoint(tmp_path / "ft"))
    assert any(p.abs().max() > 0 for n, p in ours.named_parameters() if n.endswith("lora_B"))  # it trained
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                                            tmp_path / "adapter").eval()
    ids = tokens()[:, :16]
    assert (logits(ours.eval(), ids) - logits(theirs, ids)).abs().max().item() < 1e-5
