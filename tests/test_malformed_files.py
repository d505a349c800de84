"""Every file lmforge reads that someone else wrote, fed to the real command truncated, empty,
wrong-typed and with a field missing: one line naming the file and what was expected, exit 2, no
traceback, nothing written (docs/bad-input.md). The commands run in this process (the cli's main(),
as the console script calls it). The model is tests/test_interop.py's tiny instruct Llama, saved by
transformers and imported; the scaling runs are config.yaml and summary.json alone; nothing is
downloaded or trained."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
from lmforge.config import config_to_dict, make_config  # noqa: E402
from test_interop import hf_model, run_cli, tokenizer  # noqa: E402,F401  (tokenizer: the fixture)

SUMMARY = {"steps": 10, "tokens_trained": 20480, "val_loss": 3.5, "tokens_per_s": 1000.0, "mfu": 0.01}
CHECKPOINT = "runs/x/checkpoints/step_0000000"
GENERATE = ["generate", "runs/x", "--prompt", "def", "--max-new-tokens", "1", "--device", "cpu"]
IMPORT = ["import-hf", "hf", "--out", "runs/new"]
FIT = ["scaling", "fit", "sweep", "--bootstrap", "0"]
RUNS = ["runs", "runs"]
FINETUNE = ["finetune", "runs/x", "data.source=bad.jsonl", "train.max_steps=1", "optim.warmup_steps=0",
            "--out", "runs/ft"]
TRAIN = ["train", "--model", "tiny", "--config", "bad.yaml", "--out", "runs/t"]
ADAPTER = [*GENERATE, "--adapter", "adapter"]


def variants(base: dict, missing: str, wrong: tuple[str, object]) -> list[tuple[str, str]]:
    """(what, content): empty, truncated, not an object, `missing` left out, `wrong` of the wrong type."""
    text = json.dumps(base)
    return [("empty", ""), ("truncated", text[:len(text) // 2]), ("a list", "[]"),
            (f"no {missing}", json.dumps({k: v for k, v in base.items() if k != missing})),
            (f"{wrong[0]} wrong-typed", json.dumps({**base, wrong[0]: wrong[1]}))]


@pytest.fixture(scope="module")
def world(tokenizer, tmp_path_factory) -> Path:
    """hf/ (a Hugging Face folder), runs/x (it imported), sweep/C1e12-L2 (a finished scaling run)."""
    root = tmp_path_factory.mktemp("world")
    hf_model("llama", root / "hf", tokenizer, chat=True)
    assert run_cli("import-hf", "hf", "--out", "runs/x", cwd=root).returncode == 0
    run = root / "sweep" / "C1e12-L2"
    run.mkdir(parents=True)
    cfg = make_config("tiny", overrides=["train.max_steps=10", f"data.dir={root / 'nodata'}"])
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    shutil.copytree(run, root / "sweep" / "C1e12-L3")
    (root / "runs" / "x" / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 4.0}) + "\n")
    peft_adapter(root / "hf", root / "adapter")
    assert run_cli(*ADAPTER, cwd=root).returncode == 0  # as saved by peft, it loads
    return root


def peft_adapter(base: Path, folder: Path) -> None:
    """A LoRA adapter of the model in `base` (rank 2 on q_proj and v_proj), saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(folder)


def cases(world_files: dict) -> list:
    return [pytest.param(file, content, command, id=f"{file}: {what}")
            for file, (command, contents) in world_files.items() for what, content in contents]


def hf_config_variants() -> list[tuple[str, str]]:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}
    return variants(config, "hidden_size", ("num_hidden_layers", "2")) + [
        ("a fraction for a count", json.dumps({**config, "num_hidden_layers": 2.5})),
        ("rope_scaling wrong-typed", json.dumps({**config, "rope_scaling": [1, 2]})),
        ("llama3 rope_scaling without its keys", json.dumps({**config, "rope_scaling": {"rope_type": "llama3"}}))]


FILES = {
    "hf/config.json": (IMPORT, hf_config_variants()),
    "hf/generation_config.json": (IMPORT, variants({"eos_token_id": [309, 312]}, "-", ("eos_token_id", "end"))[:3]
                                  + [("eos_token_id wrong-typed", '{"eos_token_id": ["<|eot_id|>"]}'),
                                     ("top_k wrong-typed", '{"top_k": "a"}'), ("temperature negative", '{"temperature": -1}'),
                                     ("top_p above one", '{"top_p": 5}')]),
    "hf/tokenizer.json": (IMPORT, [("empty", ""), ("truncated", '{"version": "1.0", "mod'), ("a list", "[]")]),
    "hf/tokenizer_config.json": (IMPORT, variants({"eos_token": "<|eot_id|>"}, "-", ("chat_template", 5))[:3]
                                 + [("chat_template wrong-typed", '{"chat_template": 5}')]),
    "adapter/adapter_config.json": (ADAPTER, variants({"peft_type": "LORA", "r": 2, "lora_alpha": 8,
                                                       "target_modules": ["q_proj", "v_proj"]}, "r", ("r", "two"))
                                     + [("rank_pattern wrong-typed",
                                         '{"peft_type": "LORA", "r": 2, "lora_alpha": 8, "rank_pattern": [4]}')]),
    "sweep/C1e12-L2/summary.json": (FIT, variants(SUMMARY, "tokens_trained", ("val_loss", "low"))),
    "runs/x/metrics.jsonl": (RUNS, [("a list line", "[1]\n{}\n"), ("step wrong-typed", '{"step": "ten"}\n{}\n'),
                                    ("truncated line", '{"step": 1\n{"step": 2}\n'),
                                    ("val_loss wrong-typed", '{"step": 1, "val_loss": "low"}\n')]),
    f"{CHECKPOINT}/state.json": (GENERATE, variants({"step": 0, "format": 1}, "format", ("format", "one"))),
    f"{CHECKPOINT}/manifest.json": (GENERATE, [("empty", ""), ("truncated", '{"a'), ("a list", "[]")]),
    "runs/x/config.yaml": (RUNS, [("truncated", "model: {d_model: "), ("a list", "- 1\n"),
                                  ("a section wrong-typed", "model: 5\n"),
                                  ("max_steps wrong-typed", "train: {max_steps: many}\n")]),
    "bad.yaml": (TRAIN, [("truncated", "model: {d_model: "), ("a list", "- 1\n"),
                         ("a section wrong-typed", "train: 5\n"),
                         ("a key wrong-typed", "train: {max_steps: many}\n")]),
    "bad.jsonl": (FINETUNE, [("empty", ""), ("truncated", '{"prompt": "a", "resp'), ("a list", "[]\n"),
                             ("no response", '{"prompt": "a"}\n'),
                             ("response wrong-typed", '{"prompt": "a", "response": 5}\n'),
                             ("messages wrong-typed", '{"messages": "hi"}\n'),
                             ("a message wrong-typed", '{"messages": [{"role": "user", "content": 5}]}\n')]),
}


@pytest.mark.parametrize("file, content, command", cases(FILES))
def test_a_malformed_file_stops_in_one_line_naming_it(world, tmp_path, capsys, file, content, command):
    root = tmp_path / "w"
    shutil.copytree(world, root)
    (root / file).write_text(content)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    done = run_cli(*command, cwd=root, capsys=capsys)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout and len(lines) == 1, done.stderr
    assert Path(file).name in lines[0] or Path(file).parent.name in lines[0], lines[0]
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("key, value", [("rope_theta", None), ("rope_theta", "1e4"), ("tie_word_embeddings", "false"),
                                        ("num_hidden_layers", 2.0)])
def test_a_wrong_typed_field_of_a_real_config_json_is_named(world, tmp_path, capsys, key, value):
    """The model's own config.json with one field changed (the variants above start from a minimal
    one, which any check may stop): the line names that field, and sampling from the folder stops there."""
    root = tmp_path / "w"
    shutil.copytree(world, root)
    path = root / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    done = run_cli("generate", "hf", "--prompt", "def", "--max-new-tokens", "1", "--device", "cpu", cwd=root,
                   capsys=capsys)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"config.json: {key} is {value!r}, expected" in done.stderr.strip().splitlines()[0], done.stderr
