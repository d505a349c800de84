"""Qwen2, Qwen3 and Mistral: the llama family with its build-time choices (model.qkv_bias, qk_norm,
d_head, sliding_window), against transformers' own Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM built here from random weights (nothing downloads): import, export, fp32
logits within 1e-5 (fp32 rounding of a 2-layer model is ~1e-6; a misplaced bias, norm or window
moves logits by >1e-2), greedy generation token for token, LoRA adapters through PEFT both ways,
and the sliding window in every attention backend against the float64 reference."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():  # before transformers and peft import triton (test_flash.py says why)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import (AutoModelForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from test_flash import TOLERANCE, needs_triton, output_and_grads, random_qkv  # noqa: E402
from test_interop import VOCAB, hf_logits, perturbed, tokenizer, tokens  # noqa: E402,F401 (a fixture)
from test_peft import ALPHA, RANK, TARGETS, logits, merged, random_adapter  # noqa: E402

from lmforge.accounting.shapes import model_shapes  # noqa: E402
from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.config import ModelConfig, make_config  # noqa: E402
from lmforge.data.corpus import END_OF_TEXT  # noqa: E402
from lmforge.generate.sampling import generate  # noqa: E402
from lmforge.interop.hf import export_hf, import_hf  # noqa: E402
from lmforge.interop.peft import read_peft_adapter, write_peft_adapter  # noqa: E402
from lmforge.kernels import flash_triton  # noqa: E402
from lmforge.model.attention import attention, naive_attention  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402

WINDOW = 8  # a quarter of the 32 positions the tests run: most queries lose keys to it
# each architecture's choices, as lmforge's config says them; HF's model with the same choices
CHOICES = {"qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True, d_head=32),  # heads wider than 64 / 4,
           "mistral": dict(sliding_window=WINDOW)}                                 # as Qwen3-0.6B's 128 for 1024 / 16
HF_CLASSES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, {}), "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
              "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW))}
ARCHS = list(CHOICES)


def model_config(arch: str, **changes) -> ModelConfig:
    return ModelConfig(**{**dict(family="llama", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                 max_seq_len=32, tie_embeddings=False), **CHOICES[arch], **changes})


def hf_model(arch: str, folder, tokenizer):
    """A random transformers model of `arch` and lmforge's tokenizer, saved as a download would be."""
    config_class, model_class, extra = HF_CLASSES[arch]
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT).save_pretrained(folder)
    end = tokenizer.token_to_id(END_OF_TEXT)
    torch.manual_seed(1)
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                          tie_word_embeddings=arch == "qwen2", bos_token_id=end, eos_token_id=end, **extra)
    model = perturbed(model_class(config))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("arch", [*ARCHS, "qwen2-window"])
def test_exported_model_gives_lmforge_logits_in_transformers(arch, tokenizer, tmp_path):
    cfg = model_config("qwen2", sliding_window=WINDOW) if arch == "qwen2-window" else model_config(arch)
    torch.manual_seed(0)
    model = perturbed(Transformer(cfg))
    export_hf(cfg, model.state_dict(), tokenizer, tmp_path / "hf")
    expected = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")).__name__ == expected[arch.split("-")[0]]
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)
    assert (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_imported_model_gives_its_logits_and_exports_back_bit_for_bit(arch, tokenizer, tmp_path):
    hf = hf_model(arch, tmp_path / "hf", tokenizer)
    cfg, state, tok = import_hf(tmp_path / "hf")
    assert cfg == model_config(arch, tie_embeddings=arch == "qwen2", norm_eps=1e-5)
    model = Transformer(cfg).eval()
    model.load_state_dict(state)  # strict: every bias and norm in place
    ids = tokens()
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-5
    export_hf(cfg, state, tok, tmp_path / "again")
    original, again = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)


def test_the_sliding_window_changes_the_logits_as_transformers_does(tokenizer, tmp_path):
    """Mistral's window is applied, not merely stored: without it, lmforge's logits agree with
    transformers' for the first WINDOW positions (which see every key either way) and not after."""
    hf = hf_model("mistral", tmp_path / "hf", tokenizer)
    cfg, state, _ = import_hf(tmp_path / "hf")
    unwindowed = Transformer(model_config("mistral", sliding_window=None, norm_eps=1e-5)).eval()
    unwindowed.load_state_dict(state)
    ids = tokens()
    with torch.no_grad():
        gap = (unwindowed(ids) - hf(ids).logits).abs().amax(dim=(0, 2))
    assert gap[:WINDOW].max().item() < 1e-5 and gap[WINDOW:].min().item() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_equals_transformers(arch, tokenizer, tmp_path):
    """lmforge's KV-cache decoding against generate(do_sample=False): 24 new tokens after a 6-token
    prompt, so Mistral's later steps attend through the window over cached keys."""
    hf = hf_model(arch, tmp_path / "hf", tokenizer)
    cfg, state, _ = import_hf(tmp_path / "hf")
    model = Transformer(cfg)
    model.load_state_dict(state)
    prompt = tokens()[0, :6].tolist()
    ours = generate(model, prompt, 24, temperature=0)
    hf.generation_config.eos_token_id = None  # the same 24 tokens whatever they are
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert len(ours) == 24 and ours == theirs[0, 6:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_loads_lmforge_adapter_onto_exported_base(arch, tokenizer, tmp_path):
    cfg = model_config(arch)
    torch.manual_seed(0)
    base = perturbed(Transformer(cfg)).state_dict()
    adapter = random_adapter(cfg, TARGETS["llama"])
    export_hf(cfg, base, tokenizer, tmp_path / "base")
    write_peft_adapter(adapter, cfg, RANK, ALPHA, TARGETS["llama"], tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                            tmp_path / "adapter").eval()
    ours = Transformer(cfg).eval()
    ours.load_state_dict(merged(base, adapter))
    ids = tokens()
    assert (logits(theirs, ids) - logits(ours, ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_written_by_peft_reads_into_lmforge_and_back(arch, tokenizer, tmp_path):
    hf = hf_model(arch, tmp_path / "hf", tokenizer)
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS["llama"]))
    with torch.no_grad():  # B starts at zero: make it a trained adapter
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora.eval().save_pretrained(tmp_path / "adapter")
    cfg, base, _ = import_hf(tmp_path / "hf")
    adapter, rank, alpha, targets = read_peft_adapter(tmp_path / "adapter", cfg)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(merged(base, adapter))
    ids = tokens()
    assert (logits(ours, ids) - logits(lora, ids)).abs().max().item() < 1e-5
    write_peft_adapter(adapter, cfg, rank, alpha, targets, tmp_path / "again")
    original = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)


# (heads, kv_heads, q_len, kv_len, window): windows of one key, narrower and wider than a 16-block,
# wider than the sequence, and a KV-cache-like q_len < kv_len whose window starts in the cache
WINDOW_CASES = [(2, 2, 70, 70, 1), (4, 2, 70, 70, 5), (4, 1, 70, 70, 23), (2, 2, 37, 37, 100), (4, 2, 5, 41, 7),
                (3, 3, 1, 23, 4)]


def banded_reference(q, k, v, window):
    """softmax over the keys at p - window + 1 .. p of the query at position p, by its definition."""
    q_len, kv_len = q.shape[2], k.shape[2]
    positions = torch.arange(q_len)[:, None] + kv_len - q_len
    keys = torch.arange(kv_len)[None, :]
    visible = (keys <= positions) & (keys > positions - window)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def assert_window_matches_reference(fn, case):
    heads, kv_heads, q_len, kv_len, window = case
    q, k, v, grad_out = random_qkv(heads, kv_heads, q_len, kv_len)
    expected = output_and_grads(functools.partial(banded_reference, window=window), q, k, v, grad_out, torch.float64)
    actual = output_and_grads(functools.partial(fn, window=window), q, k, v, grad_out, torch.float32)
    for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "h{}g{}-q{}k{}-w{}".format(*c))
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash_torch"])
def test_sliding_window_in_every_backend_matches_its_definition(backend, case):
    fn = functools.partial(attention, backend=backend)
    if backend == "flash_torch":  # small tiles, so that whole tiles fall outside the band and are skipped
        from lmforge.kernels.flash_torch import flash_attention_torch
        fn = functools.partial(flash_attention_torch, block_q=8, block_k=8)
    assert_window_matches_reference(fn, case)
    if backend == "naive":
        assert_window_matches_reference(naive_attention, case)


@needs_triton
@pytest.mark.parametrize("case", [WINDOW_CASES[1], WINDOW_CASES[4]], ids=lambda c: "h{}g{}-q{}k{}-w{}".format(*c))
def test_sliding_window_in_the_triton_kernels_matches_its_definition(case):
    assert_window_matches_reference(functools.partial(flash_triton.flash_attention_triton, block_q=16, block_k=16), case)


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_counts_the_parameters_the_model_has(arch, capsys):
    """Biases and q/k norm gains are in the plan's parameter count and the memory it prints."""
    from lmforge.cli import main

    overrides = {"qwen2": ["model.qkv_bias=true"], "qwen3": ["model.qk_norm=true", "model.d_head=32"],
                 "mistral": [f"model.sliding_window={WINDOW}"]}[arch]
    cfg = make_config("tiny", overrides=overrides).model
    real = Transformer(cfg)
    plain = Transformer(make_config("tiny").model)
    count = sum(p.numel() for p in dict.fromkeys(real.parameters()))
    assert model_shapes(cfg).parameters == count
    extra = {"qwen2": cfg.n_layers * (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim,  # the q, k, v biases
             "qwen3": cfg.n_layers * 2 * cfg.head_dim,  # the q and k gains, one head wide
             "mistral": 0}[arch]
    if arch != "qwen3":  # (Qwen3's wider heads also widen its projections)
        assert count - plain.num_params() == extra
    capsys.readouterr()
    assert main(["plan", "--model", "tiny", *overrides, "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["model"]["parameters"] == count


def test_architecture_settings_are_checked_in_one_line(tokenizer, tmp_path):
    for overrides, words in [(["model.sliding_window=0"], "model.sliding_window must be positive"),
                             (["model.d_head=0"], "model.d_head must be positive"),
                             (["model.family=gpt", "model.n_kv_heads=null", "model.qk_norm=true"], "llama family only")]:
        with pytest.raises(LmforgeError, match=words) as err:
            make_config("tiny", overrides=overrides)
        assert "\n" not in str(err.value)
    both = model_config("qwen3", qkv_bias=True)
    with pytest.raises(LmforgeError, match="no Hugging Face architecture has both"):
        export_hf(both, Transformer(both).state_dict(), tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
