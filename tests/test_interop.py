"""Hugging Face interop: lmforge models exported to transformers and HF models imported, both
families, compared by their logits (fp32, 1e-5) and, for HF -> lmforge -> HF, bit for bit.
Everything is built here from configs and random weights: nothing is downloaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, processors  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, PreTrainedTokenizerFast)

from lmforge.config import LLAMA3_ROPE_SCALING, MODEL_PRESETS, ModelConfig, make_config  # noqa: E402
from lmforge.data.corpus import END_OF_TEXT, train_tokenizer  # noqa: E402
from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.runs.folders import export_run, import_run  # noqa: E402
from lmforge.interop.hf import export_hf, import_hf  # noqa: E402
from lmforge.model.attention import rope_frequencies  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
VOCAB = 320
# rope scaling that matters within 32 positions: the original context is 8, most wavelengths exceed it
SCALING = dict(LLAMA3_ROPE_SCALING, factor=4.0, original_max_position_embeddings=8)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT * 3, "import os\nclass A(object):\n    pass\n"] * 5, VOCAB)


def tiny_model_config(family: str) -> ModelConfig:
    if family == "llama":  # grouped-query attention, an untied head and llama3 rope scaling
        return ModelConfig(family="llama", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_seq_len=32, tie_embeddings=False, rope_scaling=SCALING, rope_theta=500.0)
    return ModelConfig(family="gpt", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)


def perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initial value: norm gains of 1 and biases of 0 would hide a
    norm or bias copied to the wrong place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_exported_model_gives_lmforge_logits_in_transformers(family, tokenizer, tmp_path):
    cfg = tiny_model_config(family)
    torch.manual_seed(0)
    model = perturbed(Transformer(cfg))
    export_hf(cfg, model.state_dict(), tokenizer, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}[family]
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)
    assert (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item() < 1e-5


def test_exported_tokenizer_encodes_as_lmforge(tokenizer, tmp_path):
    cfg = tiny_model_config("gpt")
    export_hf(cfg, Transformer(cfg).state_dict(), tokenizer, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in (TEXT, "  x = {'a': [1, 2]}\n\tüñí ✓" + END_OF_TEXT + "tail"):
        ids = tokenizer.encode(text).ids
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert hf.eos_token == END_OF_TEXT and hf.eos_token_id == tokenizer.token_to_id(END_OF_TEXT)


# Llama 3's instruct template, in its shape: BOS, then a header and an end-of-turn token per message
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_style_tokenizer(folder: Path, base: Tokenizer, chat: bool = False) -> None:
    """A tokenizer shaped like Llama 3's: its own BOS and EOS names, BOS added by a post-processor;
    `chat`: an instruct model's, with header and end-of-turn tokens, eos_token <|eot_id|> and the
    chat template in tokenizer_config.json (as a Llama 3.x download has them)."""
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", *(CHAT_TOKENS if chat else [])])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>" if chat else "<|end_of_text|>").save_pretrained(folder)
    if chat:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(chat_template=LLAMA3_CHAT_TEMPLATE, clean_up_tokenization_spaces=False, padding_side="left")
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_model(family: str, folder: Path, tokenizer: Tokenizer, dtype=torch.float32, chat: bool = False):
    """A random HF model saved with save_pretrained, and its tokenizer, as a download would be;
    `chat` (llama): an instruct model, eos_token_id [<|end_of_text|>, <|eot_id|>] and sampling
    defaults in generation_config.json, 128 positions."""
    torch.manual_seed(1)
    if family == "llama":
        llama3_style_tokenizer(folder, tokenizer, chat)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        eos = [tok.token_to_id("<|end_of_text|>"), *([tok.token_to_id("<|eot_id|>")] if chat else [])]
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128 if chat else 32,  # room for a conversation
                             rope_parameters=dict(SCALING, rope_theta=500.0), tie_word_embeddings=True,
                             rms_norm_eps=1e-5, bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                             eos_token_id=eos if chat else eos[0])
        model = LlamaForCausalLM(config)
        if chat:
            model.generation_config.update(eos_token_id=eos, temperature=0.6, top_p=0.9, do_sample=True)
    else:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT,
                                bos_token=END_OF_TEXT).save_pretrained(folder)
        end = tokenizer.token_to_id(END_OF_TEXT)
        config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                            bos_token_id=end, eos_token_id=end, tie_word_embeddings=False)
        model = GPT2LMHeadModel(config)
    model = perturbed(model).to(dtype)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_imported_hf_model_gives_its_logits_in_lmforge(family, tokenizer, tmp_path):
    hf = hf_model(family, tmp_path / "hf", tokenizer)
    cfg, state, tok = import_hf(tmp_path / "hf")
    assert cfg.family == family and tok.to_str() == Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).to_str()
    assert cfg.rope_scaling == (SCALING if family == "llama" else None)
    model = Transformer(cfg)
    model.load_state_dict(state)  # strict: every tensor in place
    ids = tokens()
    with torch.no_grad():
        assert (model.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-5


def run_cli(*args, cwd, capsys=None):
    """`lmforge ARGS` in folder `cwd`: in this process (main(), as the console script calls it) when
    `capsys` is given, which spares a torch import per command, else as a real subprocess."""
    if capsys is None:
        return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    from lmforge.cli import main

    capsys.readouterr()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        status = main(list(args))
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("gpt", torch.bfloat16)])
def test_hf_to_lmforge_to_hf_is_bit_identical_and_generates_as_transformers(family, dtype, tokenizer, tmp_path,
                                                                           capsys):
    hf = hf_model(family, tmp_path / "hf", tokenizer, dtype)
    done = run_cli("import-hf", "hf", "--out", "runs/x", cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    done = run_cli("export", "--format", "hf", "runs/x", "--out", "again", cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    original, again = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == again.keys()
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name

    # lmforge generate on the imported run folder: greedy, the same continuation as transformers'
    prompt = "def fib"
    done = run_cli("generate", "--run", "runs/x", "--prompt", prompt, "--max-new-tokens", "8",
                   "--temperature", "0", "--device", "cpu", cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = hf.float().generate(ids, max_new_tokens=8, do_sample=False)
    assert done.stdout == prompt + hf_tok.decode(out[0, ids.shape[1]:]) + "\n"


def test_llama3_rope_scaling_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    preset = make_config("llama3-1b").model  # Llama 3.2 1B's released config.json: factor 32
    assert preset.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=preset.d_model, num_attention_heads=preset.n_heads,
                         max_position_embeddings=131072, rope_parameters=dict(preset.rope_scaling, rope_theta=preset.rope_theta))
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_frequencies(preset.head_dim, preset.rope_theta, preset.rope_scaling)
    assert attention_factor == 1.0
    # transformers computes in fp32: agreement to its rounding; unscaled frequencies differ by up to 32x
    assert torch.allclose(theirs.double(), ours, rtol=1e-6, atol=0)
    assert not torch.allclose(rope_frequencies(preset.head_dim, preset.rope_theta).float(), theirs, rtol=1e-3)
    assert MODEL_PRESETS["llama3-1b"]["rope_scaling"]["factor"] == 32.0


def one_line_error(done) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmforge: error: "), done.stderr
    return lines[0]


def test_bad_hf_folders_stop_with_one_line(tokenizer, tmp_path, capsys):
    hf_model("gpt", tmp_path / "hf", tokenizer)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({**config, "architectures": ["GemmaForCausalLM"],
                                                                 "model_type": "gemma"}))
    assert "architecture GemmaForCausalLM is not supported" in one_line_error(
        run_cli("import-hf", "gemma", cwd=tmp_path))
    (tmp_path / "hf" / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in one_line_error(run_cli("import-hf", "hf", "--out", "x", cwd=tmp_path,
                                                             capsys=capsys))
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_export_refuses_an_existing_folder_and_writes_nothing(tokenizer, tmp_path, capsys):
    cfg = tiny_model_config("gpt")
    export_hf(cfg, Transformer(cfg).state_dict(), tokenizer, tmp_path / "hf")
    assert import_run(tmp_path / "hf", tmp_path / "run") == tmp_path / "run"
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert "already exists" in one_line_error(run_cli("export", "--format", "hf", "run", "--out", "taken",
                                                      cwd=tmp_path, capsys=capsys))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    assert export_run(tmp_path / "run") == tmp_path / "run" / "hf-step_0000000"
    assert "not a training run" in one_line_error(run_cli("train", "--resume", "run", cwd=tmp_path, capsys=capsys))


def test_rope_scaling_is_a_setting_checked_like_any_other(tmp_path):
    typed = "{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16}"
    cfg = make_config("tiny", overrides=[f"model.rope_scaling={typed}"])
    assert cfg.model.rope_scaling == dict(LLAMA3_ROPE_SCALING, original_max_position_embeddings=16)
    assert make_config("tiny", overrides=["model.rope_scaling=null"]).model.rope_scaling is None
    (tmp_path / "c.yaml").write_text(f"model: {{rope_scaling: {typed}}}\n")
    assert make_config("tiny", path=tmp_path / "c.yaml").model.rope_scaling == cfg.model.rope_scaling
    for bad, words in [("{rope_type: yarn, factor: 8}", "rope_type 'yarn' is not supported"),
                       ("{rope_type: llama3, factor: 8}", "needs exactly the keys"),
                       (typed.replace("high_freq_factor: 4", "high_freq_factor: 0.5"), "must be below")]:
        with pytest.raises(LmforgeError, match=words):
            make_config("tiny", overrides=[f"model.rope_scaling={bad}"])
    with pytest.raises(LmforgeError, match="llama family only"):
        make_config("gpt2-124m", overrides=[f"model.rope_scaling={typed}"])
    # a config holding a dict is still planned (the accounting caches shapes by the config's values)
    from lmforge.accounting.shapes import model_shapes

    assert model_shapes(make_config("llama3-1b").model).parameters == 1_235_814_400


def test_trained_run_exports_to_transformers_and_imports_back(corpus_dir, data_dir, tmp_path, capsys):
    """The commands as README shows them, on a run `lmforge train` wrote (tied head, lmforge's tokenizer)."""
    from conftest import tiny_overrides
    from lmforge.cli import main
    from lmforge.runs.checkpoint.find import find_checkpoint
    from lmforge.runs.checkpoint.read import load_model_weights

    run = tmp_path / "runs" / "tiny"
    assert main(["train", "--model", "tiny", "--out", str(run), "--no-progress",
                 *tiny_overrides(corpus_dir, data_dir, max_steps=4)]) == 0
    assert main(["export", "--format", "hf", str(run)]) == 0
    path = find_checkpoint(run)
    model = Transformer(make_config("tiny").model).eval()
    load_model_weights(model, path)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_logits(run / "hf-step_0000004", ids) - model(ids)).abs().max().item() < 1e-5
    assert main(["import-hf", str(run / "hf-step_0000004"), "--out", str(tmp_path / "runs" / "back")]) == 0
    back = Transformer(make_config("tiny").model).eval()
    load_model_weights(back, find_checkpoint(tmp_path / "runs" / "back"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs")]) == 0
    assert "back" in capsys.readouterr().out
