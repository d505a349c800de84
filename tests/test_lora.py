"""LoRA (model/lora.py), fine-tuning data (data/sft.py) and `lmforge finetune` (train/finetune.py)."""

import json
import random
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from lmforge.cli import main
from lmforge.config import make_config
from lmforge.data.sft import encode_example, example_parts, pad_examples
from lmforge.model.transformer import IGNORE_INDEX
from lmforge.data.corpus import END_OF_TEXT
from lmforge.common.errors import LmforgeError
from lmforge.model.lora import (LoRALinear, adapter_state_dict, apply_lora, load_adapter_state_dict, lora_layers,
                                merge_lora)
from lmforge.precision.fp8 import Fp8Linear
from lmforge.runs.checkpoint.read import read_tensors
from lmforge.runs.checkpoint.tensors import stored_tensors
from lmforge.runs.load import base_checkpoint, model_from_checkpoint
from lmforge.train.loop import Trainer
from lmforge.modes import get_policy
from lmforge.train.setup import build_model
from tests.conftest import tiny_overrides

ALL_LINEARS = "attn.*,mlp.*"


def tiny_model(*overrides):
    torch.manual_seed(0)
    cfg = make_config("tiny", overrides=list(overrides))
    return build_model(cfg, get_policy(cfg.train.precision))


def randomize_adapters(model):
    """B starts at zero; give it values, as training would."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0, 0.05)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_lora_at_step_0_gives_the_base_models_outputs(recompute):
    model = tiny_model(f"train.recompute={recompute}")
    tokens = torch.randint(0, 512, (2, 32))
    base = model(tokens)
    apply_lora(model, ALL_LINEARS, rank=4, alpha=8)
    assert torch.equal(model(tokens), base)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 2 * 7
    # A is Kaiming-uniform (as nn.Linear's default, bound 1/sqrt(in_features)), B zero
    layer = model.blocks["0"].attn.q_proj
    assert layer.lora_A.abs().max() <= 1 / 64**0.5 and layer.lora_A.std() > 0 and not layer.lora_B.any()


def test_merged_equals_unmerged_and_unmerge_restores_the_weight_exactly():
    model = tiny_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    apply_lora(model, ALL_LINEARS, rank=8, alpha=16)
    randomize_adapters(model)
    tokens = torch.randint(0, 512, (2, 32))
    unmerged = model(tokens)
    assert not torch.allclose(unmerged, tiny_model()(tokens))  # the adapters do change the outputs
    merge_lora(model)
    layer = model.blocks["1"].mlp.down_proj
    assert torch.equal(layer.base.weight, before["blocks.1.mlp.down_proj.weight"] + 2.0 * layer.lora_B @ layer.lora_A)
    torch.testing.assert_close(model(tokens), unmerged, rtol=1e-5, atol=1e-5)  # fp32 rounding only
    for merged in lora_layers(model).values():
        merged.unmerge()
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name  # bit for bit: restored, not subtracted
    assert torch.equal(model(tokens), unmerged)


def test_names_stay_canonical_and_only_the_adapters_are_trainable():
    model = tiny_model("train.recompute=full")
    names = set(model.state_dict())
    apply_lora(model, "q_proj,v_proj", rank=4)
    wrapped = set(model.state_dict())
    adapters = {f"blocks.{i}.attn.{p}.lora_{m}" for i in (0, 1) for p in ("q_proj", "v_proj") for m in "AB"}
    assert wrapped == names | adapters
    assert set(adapter_state_dict(model)) == adapters
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"blocks.{n.split('.')[1]}._checkpoint_wrapped_module.{n.split('.', 2)[2]}" for n in adapters}
    # a plain checkpoint of the base loads into the wrapped model by name
    model.load_state_dict(tiny_model().state_dict(), strict=False)
    with pytest.raises(LmforgeError, match="rank or another base"):
        other = apply_lora(tiny_model(), "q_proj,v_proj", rank=8)
        load_adapter_state_dict(other, adapter_state_dict(model))
    with pytest.raises(LmforgeError, match="other LoRA targets"):
        load_adapter_state_dict(apply_lora(tiny_model(), "q_proj", rank=4), adapter_state_dict(model))


def test_lora_composes_with_bf16_pure_and_fp8():
    model = tiny_model("train.precision=bf16-pure", "finetune.lora_rank=4")
    layer = model.blocks["0"].attn.q_proj
    assert layer.base.weight.dtype == torch.bfloat16 and layer.lora_A.dtype == torch.float32
    model(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))).backward()
    assert layer.lora_B.grad.dtype == torch.float32 and layer.base.weight.grad is None

    model = tiny_model("train.precision=fp8", "finetune.lora_rank=4")
    layer = model.blocks["0"].attn.q_proj
    assert type(layer.base) is Fp8Linear and type(model.blocks["0"].mlp.up_proj) is Fp8Linear


def test_masked_sft_loss_equals_a_hand_computation(tmp_path, corpus_dir):
    from lmforge.data.corpus import train_tokenizer

    tokenizer = train_tokenizer([p.read_text() for p in sorted(corpus_dir.glob("*.py"))[:5]], 300)
    end = tokenizer.token_to_id(END_OF_TEXT)
    records = [{"prompt": "def add(a, b):\n", "response": "    return a + b"},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    encoded = []
    for index, record in enumerate(records):
        ids, trained = encode_example(tokenizer, example_parts(record, f"r{index}"))
        encoded.append((f"r{index}", ids, trained))
    examples = pad_examples(encoded, seq_len=48, end=end)
    prompt_len = len(tokenizer.encode("def add(a, b):\n").ids)
    response = tokenizer.encode("    return a + b").ids + [end]
    # the first example's targets: nothing before the response, then the response and end-of-text
    expected = [IGNORE_INDEX] * (prompt_len - 1) + response
    assert examples.targets[0].tolist() == expected + [IGNORE_INDEX] * (48 - len(expected))
    assert examples.tokens[0, :prompt_len + len(response)].tolist() == tokenizer.encode("def add(a, b):\n").ids + response
    # chat: headers and the user's turn untrained, the assistant's "hello\n" and end-of-text trained
    trained_text = tokenizer.decode([t for t in examples.targets[1].tolist() if t != IGNORE_INDEX])
    assert trained_text == "hello\n"

    model = tiny_model("model.vocab_size=300")
    x, y = torch.from_numpy(examples.tokens[:, :-1]), torch.from_numpy(examples.targets)
    logits = model(x)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    by_hand = [-log_probs[b, t, y[b, t]] for b in range(2) for t in range(48) if y[b, t] != IGNORE_INDEX]
    assert torch.allclose(model(x, y), torch.stack(by_hand).mean(), rtol=1e-6, atol=0)
    assert len(by_hand) == len(response) + len(tokenizer.encode("hello\n").ids) + 1


def write_pairs(path, count=64, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randrange(50), rng.randrange(50)
            f.write(json.dumps({"prompt": f"def f{a}(x):\n    return x +", "response": f" {b}\n"}) + "\n")
    return path


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus_dir, data_dir):
    """A tiny pretrained run to fine-tune."""
    run = tmp_path_factory.mktemp("base") / "base"
    cfg = make_config("tiny", overrides=tiny_overrides(corpus_dir, data_dir, max_steps=4))
    Trainer(cfg, run, console=Console(quiet=True), progress=False).run()
    return run


def finetune_config(base_run, pairs, *extra, **train):
    settings = {"max_steps": 6, "batch_size": 4, "seq_len": 24, "eval_interval": 3, "eval_batches": 2,
                "checkpoint_interval": 3, "log_interval": 2, "sample_tokens": 0, **train}
    cfg = make_config(None, overrides=[f"finetune.base={base_run}", f"data.source={pairs}", "optim.warmup_steps=2",
                                       *(f"train.{k}={v}" for k, v in settings.items()), *extra])
    cfg.model = model_from_checkpoint(base_checkpoint(base_run))[0].model
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_a_lora_run_changes_only_the_adapters_and_its_bytes_match_the_plan(base_run, tmp_path, precision):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    cfg = finetune_config(base_run, pairs, "finetune.lora_rank=4", "finetune.lora_targets=attn.*,mlp.up_proj",
                          f"train.precision={precision}")
    trainer = Trainer(cfg, tmp_path / "ft", console=Console(quiet=True), progress=False)
    _, base, _ = model_from_checkpoint(base_checkpoint(base_run))
    before = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    for name, value in base.state_dict().items():  # it starts from the base's weights
        assert torch.equal(before[name], value.to(before[name].dtype)), name
    summary = trainer.run()
    after = trainer.model.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed == set(adapter_state_dict(trainer.model))
    assert len(changed) == 2 * 5 * 2  # A and B of 5 layers in each of 2 blocks
    # trainable parameters, gradient and optimizer bytes: the plan's, to the byte
    rank, d, kv, ffn = 4, 64, 32, 192
    trainable = 2 * rank * ((d + d) * 2 + (d + kv) * 2 + (d + ffn))
    assert trainer.plan["lora"]["trainable_parameters"] == trainable
    comparison = summary["predicted_vs_measured"]
    for key in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes"):
        assert comparison[key]["predicted"] == comparison[key]["measured"], key
    assert comparison["gradients_bytes"]["measured"] == 4 * trainable
    assert comparison["optimizer_states_bytes"]["measured"] == 2 * 4 * trainable
    # a LoRA checkpoint holds the adapters only
    stored = stored_tensors(tmp_path / "ft" / "checkpoints" / "step_0000006", "model")
    assert set(stored) == set(adapter_state_dict(trainer.model))


def lmforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_finetune_end_to_end_resumes_exactly_and_generates(base_run, tmp_path, capsys):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    common = ["--base", str(base_run), "--lora-rank", "4", "--lora-alpha", "8", "--no-progress",
              f"data.source={pairs}", "train.max_steps=6", "train.batch_size=4", "train.seq_len=24",
              "train.eval_interval=3", "train.eval_batches=2", "train.checkpoint_interval=3", "train.log_interval=1",
              "train.sample_tokens=0", "optim.warmup_steps=2", "finetune.lora_dropout=0.1"]
    straight = lmforge("finetune", *common, "--out", "a", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    # the same run stopped after its step-3 checkpoint (max_steps=3), then resumed to 6
    first = lmforge("finetune", *[c for c in common if c != "train.max_steps=6"], "train.max_steps=3",
                    "optim.decay_steps=6", "--out", "b", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = lmforge("finetune", "--resume", "b", "train.max_steps=6", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    for name in ("model", "optimizer"):
        a = read_tensors(tmp_path / "a" / "checkpoints" / "step_0000006", name)
        b = read_tensors(tmp_path / "b" / "checkpoints" / "step_0000006", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    strip = lambda run: [{k: v for k, v in json.loads(line).items() if k not in
                          ("tokens_per_s", "mfu", "time", "elapsed_s", "peak_memory_bytes")}
                         for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert strip("a") == strip("b")  # (a record every step: b's stop at step 3 closes no logging window early)

    # generate (in this process: one more interpreter start costs more than the sampling): base +
    # adapter, and merged, greedy: the same text
    outputs = []
    for merge in ([], ["--merge"]):
        assert main(["generate", "--run", str(tmp_path / "a"), "--prompt", "def f1(x):\n    return x +",
                     "--max-new-tokens", "8", "--temperature", "0", *merge]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("def f1(x):\n    return x +")


def test_finetune_errors_are_one_line(base_run, tmp_path, capsys):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    common = ["--base", str(base_run), f"data.source={pairs}", "--out", str(tmp_path / "x")]
    for args, message in [
        (["--lora-rank", "0"], "finetune.lora_rank must be >= 1, got 0 (leave it out for full fine-tuning)"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,wq"], "LoRA target 'wq' matches no linear layer of this "
                                                              "model; its layers are down_proj, gate_proj, k_proj, "
                                                              "o_proj, q_proj, up_proj, v_proj"),
        (["model.n_layers=3"], "cannot set model.n_layers: a fine-tuning run keeps its base's model (use --base)"),
    ]:
        assert main(["finetune", *common, *args]) == 2
        assert capsys.readouterr().err == f"lmforge: error: {message}\n"
        assert not (tmp_path / "x").exists()


def test_an_adapter_for_another_base_is_refused(base_run, tmp_path, corpus_dir, data_dir, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    cfg = finetune_config(base, pairs, "finetune.lora_rank=4", max_steps=3)
    Trainer(cfg, tmp_path / "ft", console=Console(quiet=True), progress=False).run()
    # the base trains on: its newest checkpoint now holds other weights
    more = make_config("tiny", overrides=tiny_overrides(corpus_dir, data_dir, max_steps=8))
    Trainer(more, base, resume=True, console=Console(quiet=True), progress=False).run()
    run = str(tmp_path / "ft")
    for args in (["generate", "--run", run, "--prompt", "x"], ["finetune", "--resume", run, "train.max_steps=6"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("lmforge: error: ") and err.count("\n") == 1, err
        assert "is an adapter for another base" in err and "point finetune.base at the original base" in err
