"""A model's special tokens as the model defines them: one BOS, every eos_token_id a stop, the
model's own chat template, all kept through import, fine-tuning and export, and PEFT adapter
folders taken by generate and finetune. Checked against transformers on tiny Llama 3 shaped
models built here (tests/test_interop.py's hf_model with chat=True); nothing is downloaded."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lmforge.data.sft import load_examples  # noqa: E402
from lmforge.interop.hf import read_hf_special_tokens  # noqa: E402
from lmforge.interop.hf import import_hf  # noqa: E402
from test_interop import hf_model, run_cli, tokenizer  # noqa: E402,F401  (tokenizer: the fixture)

CONVERSATIONS = [
    [{"role": "system", "content": "Be short."}, {"role": "user", "content": "def fib"},
     {"role": "assistant", "content": "import os"}],
    [{"role": "user", "content": "class A"}, {"role": "assistant", "content": "  pass\n"},
     {"role": "user", "content": "return n"}, {"role": "assistant", "content": "fibonacci(n - 1)"}],
]
PAIRS = [{"prompt": "def fibonacci(n):\n", "response": "    return n"}, {"prompt": "import os", "response": " class A"}]


@pytest.fixture
def instruct(tokenizer, tmp_path):
    """An instruct model folder: BOS by a post-processor, eos list [<|end_of_text|>, <|eot_id|>]."""
    hf_model("llama", tmp_path / "hf", tokenizer, chat=True)
    return tmp_path / "hf"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_sft_examples_are_the_token_ids_transformers_gives(instruct, tmp_path):
    """messages: apply_chat_template's ids, the assistant turns (content and <|eot_id|>) trained;
    prompt/response: the tokenizer's ids of the prompt, then the response's without special tokens,
    then the end token. One BOS either way (the post-processor would add one per part)."""
    hf_tok = AutoTokenizer.from_pretrained(instruct)
    _, _, tok = import_hf(instruct)
    special = read_hf_special_tokens(instruct, tok)
    bos, eot = hf_tok.convert_tokens_to_ids("<|begin_of_text|>"), hf_tok.convert_tokens_to_ids("<|eot_id|>")
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS] + PAIRS)
    splits = load_examples(str(source), tok, 96, 0.0, special.end, special)[:2]
    rows = {name: (split, row) for split in splits for row, name in enumerate(split.names)}

    def example(line):
        split, row = rows[f"chat.jsonl:{line}"]
        return split.tokens[row], split.targets[row]

    for line, messages in enumerate(CONVERSATIONS, start=1):
        tokens, targets = example(line)
        expected = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert tokens[:len(expected)].tolist() == expected
        assert expected.count(bos) == 1 and expected[-1] == eot  # ends with a stop: nothing appended
        trained = [t for t in targets.tolist() if t >= 0]
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert hf_tok.decode(trained, skip_special_tokens=False) == "".join(a + "<|eot_id|>" for a in answers)
    end = hf_tok.convert_tokens_to_ids(special.end)
    for line, pair in enumerate(PAIRS, start=len(CONVERSATIONS) + 1):
        tokens, targets = example(line)
        response = hf_tok(pair["response"], add_special_tokens=False)["input_ids"] + [end]
        expected = hf_tok(pair["prompt"])["input_ids"] + response
        assert tokens[:len(expected)].tolist() == expected and expected.count(bos) == 1
        assert [t for t in targets.tolist() if t >= 0] == response


def stopping_prompt(folder):
    """Make <|eot_id|> likely (its tied embedding scaled up, the model saved again) and find a prompt
    after which transformers' greedy generation stops at it, not at the first token nor by the
    budget: (prompt, the tokens transformers generates before stopping)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder)
    eot = hf_tok.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[eot] *= 6.0
    model.save_pretrained(folder)
    for word in ["def", "class", "import", "return", "fibonacci", "pass", "os", "n", "if", "A", "object"] * 3:
        for prefix in ("", " ", "  ", "\n"):
            ids = hf_tok(prefix + word, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
            if len(out) >= 3 and out[-1] == eot:
                return prefix + word, out[:-1]
    raise AssertionError("no prompt makes this model stop at <|eot_id|>")


@pytest.mark.parametrize("generation", [None, {"temperature": 0.6}, {"eos_token_id": [309, 312]}])
def test_every_eos_token_id_of_config_or_generation_config_stops(instruct, generation):
    """An eos_token_id list stops at any of its ids, wherever the folder gives it: generation_config.json,
    or config.json alone (no generation_config.json, or one that names no eos_token_id)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(instruct / "tokenizer.json"))
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    (instruct / "generation_config.json").unlink()
    if generation is not None:
        (instruct / "generation_config.json").write_text(json.dumps(generation))
    assert set(read_hf_special_tokens(instruct, tok).stop_ids) == set(eos)
    from lmforge.runs.folders import import_run
    from lmforge.runs.load import model_special_tokens

    run = import_run(instruct, instruct.parent / "run")  # and a run imported from it
    assert set(model_special_tokens(run, tok).stop_ids) == set(eos)


def test_instruct_model_stops_where_transformers_generate_stops(instruct, tmp_path, capsys):
    prompt, expected = stopping_prompt(instruct)
    hf_tok = AutoTokenizer.from_pretrained(instruct)
    for model in ("hf", "runs/x"):  # the Hugging Face folder itself, and imported as a run folder
        if model == "runs/x":
            assert run_cli("import-hf", "hf", "--out", "runs/x", cwd=tmp_path, capsys=capsys).returncode == 0
        done = run_cli("generate", model, "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0",
                       "--device", "cpu", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout == prompt + hf_tok.decode(expected, skip_special_tokens=True) + "\n"


def assert_same_model_files(original, exported):
    """The chat template renders the same, and generation_config / tokenizer_config / the token ids
    of config.json say the same."""
    theirs, ours = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(exported)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours.bos_token == "<|begin_of_text|>" and ours("x")["input_ids"] == theirs("x")["input_ids"]
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert json.loads((exported / name).read_text()) == json.loads((original / name).read_text()), name
    config, source = (json.loads((folder / "config.json").read_text()) for folder in (exported, original))
    assert (config["bos_token_id"], config["eos_token_id"]) == (source["bos_token_id"], source["eos_token_id"])
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert (generation.eos_token_id, generation.temperature, generation.top_p) == (source["eos_token_id"], 0.6, 0.9)


def test_import_finetune_export_keep_the_template_stops_and_defaults(instruct, tmp_path, capsys):
    """HF -> run folder -> HF, and HF -> LoRA fine-tuning on messages (default alpha) -> HF and PEFT:
    the exported folders keep what came in; the PEFT adapter says lora_alpha 2r and PEFT loads it.
    The import and fine-tuning run in this process (main(), as the console script calls it); the
    exports, whose output is checked, as subprocesses."""
    assert run_cli("import-hf", "hf", "--out", "runs/x", cwd=tmp_path, capsys=capsys).returncode == 0
    assert run_cli("export", "runs/x", "--format", "hf", "--out", "again", cwd=tmp_path).returncode == 0
    assert_same_model_files(instruct, tmp_path / "again")

    short = [{"role": "user", "content": "def"}, {"role": "assistant", "content": "pass"}]  # fits 32 positions
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": short}] * 16)
    done = run_cli("finetune", "hf", "--lora-rank", "4", "--no-progress", "--out", "ft", "data.source=chat.jsonl",
                   "train.max_steps=2", "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1",
                   "train.sample_tokens=0", "train.tensorboard=false", "optim.warmup_steps=1", cwd=tmp_path,
                   capsys=capsys)
    assert done.returncode == 0, done.stderr
    for fmt in ("hf", "peft"):
        done = run_cli("export", "ft", "--format", fmt, "--out", f"ft-{fmt}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert_same_model_files(instruct, tmp_path / "ft-hf")
    adapter = json.loads((tmp_path / "ft-peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8.0  # model/lora.py's default, 2 r
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(instruct), tmp_path / "ft-peft")


def test_peft_adapter_folders_in_generate_and_finetune(instruct, tmp_path, capsys):
    """`generate --adapter` on the base equals generating from the LoRA run the adapter came from;
    `finetune --adapter` continues it: its rank, alpha and weights are where training starts."""
    from lmforge.generate.load import load_for_sampling
    from lmforge.model.lora import adapter_state_dict

    write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 16)
    common = ["--no-progress", "data.source=pairs.jsonl", "train.batch_size=2", "train.seq_len=16",
              "train.eval_batches=1", "train.sample_tokens=0", "train.tensorboard=false", "optim.warmup_steps=1"]
    done = run_cli("finetune", "hf", "--lora-rank", "2", "--lora-alpha", "3", "--out", "ft", "train.max_steps=2",
                   "optim.lr=5e-2", *common, cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert run_cli("export", "ft", "--format", "peft", "--out", "adapter", cwd=tmp_path, capsys=capsys).returncode == 0
    outputs = [run_cli("generate", *run, "--prompt", "def fib", "--max-new-tokens", "6", "--temperature", "0",
                       "--device", "cpu", cwd=tmp_path) for run in (["ft"], ["hf", "--adapter", "adapter"])]
    assert all(done.returncode == 0 for done in outputs), [done.stderr for done in outputs]
    assert outputs[0].stdout == outputs[1].stdout

    # one step at a learning rate of 1e-30: the continued adapter is the PEFT one to fp32 rounding
    done = run_cli("finetune", "hf", "--adapter", "adapter", "--out", "ft2", "train.max_steps=1", "optim.lr=1e-30",
                   *common, cwd=tmp_path, capsys=capsys)
    assert done.returncode == 0, done.stderr
    continued, start = (load_for_sampling(tmp_path / "ft2")[0].model,
                        load_for_sampling(tmp_path / "hf", adapter=tmp_path / "adapter")[0].model)
    ours, theirs = adapter_state_dict(continued), adapter_state_dict(start)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    layer = next(m for m in continued.modules() if hasattr(m, "lora_A"))
    assert (layer.rank, layer.alpha) == (2, 3.0)


def test_bad_adapter_folders_stop_with_one_line(instruct, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for args in (["generate", "hf", "--adapter", "empty"], ["finetune", "hf", "--adapter", "empty",
                                                             "data.source=x.jsonl"],
                 ["finetune", "hf", "--adapter", "empty", "--lora-rank", "4", "data.source=x.jsonl"]):
        done = run_cli(*args, cwd=tmp_path, capsys=capsys)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "adapter" in done.stderr
