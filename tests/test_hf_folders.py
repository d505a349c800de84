"""Someone else's model, end to end: a Hugging Face folder read as it is by generate, export, plan,
eval-format and finetune (issue 28). The folder is a tiny Llama-style model built here (bf16, its
config.json saying max_position_embeddings=131072, as Llama 3.x's does), so that a cache sized for
the model's positions, or a fine-tuning row padded to them, would show. Nothing is downloaded."""

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
from test_interop import hf_model, one_line_error, run_cli, tokenizer  # noqa: E402,F401 (a fixture)
from tokenizers import Tokenizer  # noqa: E402

from lmforge.data.sft import load_examples  # noqa: E402
from lmforge.generate.sampling import KVCache, generate  # noqa: E402
from lmforge.model.transformer import IGNORE_INDEX  # noqa: E402
from lmforge.runs.load import load_model  # noqa: E402

POSITIONS = 131_072
PROMPT = "def fibonacci(n):"
NEW = 8


@pytest.fixture(scope="module")
def hf_folder(tokenizer, tmp_path_factory) -> Path:
    """A bf16 Llama-style HF folder whose config.json says 131,072 positions (the weights do not
    depend on it: rotary positions are computed, not stored)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    hf_model("llama", folder, tokenizer, torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS}))
    return folder


def hub_cache(folder: Path, root: Path) -> Path:
    """`folder` laid out as the hub cache stores a download: blobs, a snapshot of links, refs/main."""
    repo = root / "models--someone--tiny-llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (repo / "blobs" / file.name).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return repo


def lmforge(*args, cwd) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd)  # a real subprocess


def test_generate_reads_a_hf_folder_its_hub_snapshot_and_its_imported_run_alike(hf_folder, tmp_path, capsys):
    repo = hub_cache(hf_folder, tmp_path)
    greedy = ("--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0")
    direct = lmforge("generate", str(hf_folder), *greedy, cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.startswith(PROMPT) and len(direct.stdout) > len(PROMPT) + 1
    # the same model through the hub cache (its folder and its snapshot) and through import-hf
    assert run_cli("import-hf", str(hf_folder), "--out", "runs/x", cwd=tmp_path, capsys=capsys).returncode == 0
    for path in (repo, repo / "snapshots" / "0123abcd", tmp_path / "runs" / "x"):
        done = run_cli("generate", str(path), *greedy, cwd=tmp_path, capsys=capsys)
        assert (done.returncode, done.stdout) == (0, direct.stdout), path
    # greedy decoding as transformers does it, at the same (bf16) weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.bfloat16).eval()
    ids = Tokenizer.from_file(str(hf_folder / "tokenizer.json")).encode(PROMPT).ids
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)[0, len(ids):]
    loaded = load_model(hf_folder)
    assert generate(loaded.model, ids, NEW, temperature=0) == theirs.tolist()


def test_weights_keep_their_stored_dtype_unless_another_is_asked_for(hf_folder):
    auto = load_model(hf_folder)
    assert {p.dtype for p in auto.model.parameters()} == {torch.bfloat16}
    assert auto.model.rope.cos.dtype == torch.float32  # positions stay exact
    assert auto.model.lm_head.weight is auto.model.tok_embeddings.weight  # tied, once
    wide = load_model(hf_folder, dtype="fp32")
    assert {p.dtype for p in wide.model.parameters()} == {torch.float32}
    for (name, a), (_, b) in zip(auto.model.state_dict().items(), wide.model.state_dict().items()):
        assert torch.equal(a.float(), b), name  # bf16 -> fp32 is exact


def test_generate_holds_a_cache_for_the_prompt_and_new_tokens_as_the_plan_counts_it(hf_folder, tmp_path, capsys):
    """--stats reports the bytes of the cache generation filled (read after it, so growth would
    show), from its tensors; at the model's 131,072 positions it would be 32 MiB."""
    done = lmforge("generate", str(hf_folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--stats",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    weights_line, cache_line = done.stderr.strip().splitlines()[-2:]
    positions = len(Tokenizer.from_file(str(hf_folder / "tokenizer.json")).encode(PROMPT).ids) + NEW
    assert cache_line.startswith(f"KV cache: {positions} positions in bfloat16, ")
    held = int(cache_line.split(", ")[1].split()[0].replace(",", ""))
    plan = run_cli("plan", "--inference", str(hf_folder), "--seq-len", str(positions), "--hardware", "h100-sxm",
                   "--json", cwd=tmp_path, capsys=capsys)
    plan = json.loads(plan.stdout)
    assert (plan["setup"]["weights"], plan["setup"]["kv_dtype"]) == ("bf16", "bf16")  # the folder's own dtype
    # K and V x 2 layers x 2 KV heads x head dim 16 x 2 bytes (bf16) per position
    assert held == plan["memory"]["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 2 * positions
    weight_bytes = int(weights_line.split(", ")[1].split()[0].replace(",", ""))
    assert weight_bytes == sum(plan["memory"]["weights_bytes"].values())


def test_the_cache_grows_when_a_generation_outruns_it():
    from lmforge.config import make_config
    from lmforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(make_config("tiny").model).eval()
    cache = KVCache.for_model(model, 2)
    assert cache.capacity == 2
    grown = generate(model, [5, 6, 7], 20, temperature=0, cache=cache)
    assert grown == generate(model, [5, 6, 7], 20, temperature=0, use_cache=False)
    # 22 positions fed (the prompt, then 19 of the 20 new tokens), each growth at least doubling: 2 -> 4 -> ... -> 32
    cfg = model.cfg
    assert cache.capacity == 32 and cache.nbytes == 2 * cfg.n_layers * cfg.kv_heads * 32 * cfg.head_dim * 4


def test_export_plan_and_eval_format_take_a_hf_folder(hf_folder, tmp_path, capsys):
    done = run_cli("export", str(hf_folder), "--format", "hf", "--out", "again", cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ours, theirs = (transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits
                        for path in (tmp_path / "again", hf_folder))
    assert torch.equal(ours, theirs)  # the same bf16 weights, bit for bit
    assert "a Hugging Face folder: give --out" in one_line_error(
        run_cli("export", str(hf_folder), "--format", "hf", cwd=tmp_path, capsys=capsys))
    assert "not a LoRA run" in one_line_error(
        run_cli("export", str(hf_folder), "--format", "peft", "--out", "p", cwd=tmp_path, capsys=capsys))
    training = run_cli("plan", str(hf_folder), "--hardware", "h100-sxm", "--json", cwd=tmp_path, capsys=capsys)
    assert json.loads(training.stdout)["model"]["parameters"] == sum(
        p.numel() for p in load_model(hf_folder).model.parameters())
    done = lmforge("eval-format", str(hf_folder), "--tasks", "1", "--kinds", "addition", "--modes", "free",
                   "--max-new-tokens", "4", "--out", "study", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "study" / "table.md").is_file() and not (hf_folder / "eval-format").exists()


def test_a_folder_that_is_no_model_gets_one_line_saying_what_was_expected(hf_folder, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    expected = ("empty is neither an lmforge run folder (config.yaml, checkpoints/) nor a Hugging Face model "
                "folder (config.json, *.safetensors, tokenizer.json)")
    assert one_line_error(lmforge("generate", "empty", "--prompt", "x", cwd=tmp_path)) == f"lmforge: error: {expected}"
    for args in (["export", "empty", "--format", "hf"], ["plan", "empty", "--inference"],
                 ["eval-format", "empty"], ["finetune", "empty", "data.source=x.jsonl"]):
        line = one_line_error(run_cli(*args, cwd=tmp_path, capsys=capsys))
        assert line == f"lmforge: error: {expected}" and "delete" not in line, args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def write_pairs(path: Path, n: int = 12) -> Path:
    with path.open("w") as out:
        for i in range(n):
            out.write(json.dumps({"prompt": f"def f{i}(x):\n", "response": "    return x" + " + 1" * (i % 5)}) + "\n")
    return path


def test_finetune_pads_examples_to_the_longest_not_to_the_models_positions(hf_folder, tmp_path):
    write_pairs(tmp_path / "pairs.jsonl")
    done = lmforge("finetune", str(hf_folder), "--lora-rank", "4", "data.source=pairs.jsonl", "train.max_steps=1",
                   "train.batch_size=2", "train.eval_interval=1", "train.checkpoint_interval=1",
                   "train.sample_tokens=0", "--out", "runs/ft", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seq_len = yaml.safe_load((tmp_path / "runs" / "ft" / "config.yaml").read_text())["train"]["seq_len"]
    # the longest example as training lays it out (rows padded far beyond it): its last target + 1
    tok = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    sets = load_examples(str(tmp_path / "pairs.jsonl"), tok, 256, 0.1, "<|end_of_text|>")
    longest = max(int(np.nonzero(row != IGNORE_INDEX)[0].max()) + 1 for ex in sets[:2] for row in ex.targets)
    assert seq_len == math.ceil(longest / 8) * 8 and seq_len < POSITIONS
    assert (f"train.seq_len {seq_len}: the longest of 12 examples fills {longest} positions, rounded up to a "
            f"multiple of 8") in done.stdout


def test_a_step_that_cannot_fit_the_device_is_refused_before_anything_is_read(hf_folder, tmp_path, capsys):
    write_pairs(tmp_path / "pairs.jsonl")
    line = one_line_error(run_cli("finetune", str(hf_folder), "data.source=pairs.jsonl", f"train.seq_len={POSITIONS}",
                                  "train.batch_size=1024", "--out", "runs/big", cwd=tmp_path, capsys=capsys))
    assert "per device" in line and "lower train.batch_size (now 1024) or train.seq_len (now 131,072)" in line
    assert not (tmp_path / "runs").exists()
