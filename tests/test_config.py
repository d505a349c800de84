import subprocess
import sys

import pytest
import torch
import yaml
from rich.console import Console

from lmforge.config import MODEL_PRESETS, config_to_dict, config_warnings, load_config, make_config
from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import Transformer
from lmforge.train.loop import Trainer


def param_count(preset: str) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return Transformer(make_config(preset).model).num_params()


@pytest.mark.parametrize("preset, expected", [
    ("gpt2-124m", 124_439_808),      # Hugging Face gpt2
    ("gpt2-350m", 354_823_168),      # Hugging Face gpt2-medium
    ("llama2-7b", 6_738_415_616),    # meta-llama/Llama-2-7b-hf
    ("llama3-8b", 8_030_261_248),    # meta-llama/Meta-Llama-3-8B
    ("llama3-70b", 70_553_706_496),  # meta-llama/Meta-Llama-3-70B
    ("llama3-1b", 1_235_814_400),    # meta-llama/Llama-3.2-1B
])
def test_preset_parameter_counts_match_published_models(preset, expected):
    assert param_count(preset) == expected


def test_gpt3_preset_is_175b():
    assert abs(param_count("gpt3-175b") / 175e9 - 1) < 0.005


def test_feed_forward_width_is_derived_from_the_model_width():
    assert make_config("small").model.ffn_dim == 704  # 8/3 * 256 = 682.7, rounded up to a multiple of 64
    assert make_config("small", overrides=["model.d_model=384", "model.n_heads=6"]).model.ffn_dim == 1024
    assert make_config("gpt2-124m").model.ffn_dim == 3072  # 4 * d_model
    assert make_config("llama3-8b").model.ffn_dim == 14336  # published, not derived


def test_every_preset_validates():
    for preset in MODEL_PRESETS:
        make_config(preset)


def test_overrides_are_typed():
    cfg = make_config("tiny", overrides=["model.n_layers=3", "optim.lr=3e-4", "model.tie_embeddings=false",
                                         "train.seq_len=32", "model.n_kv_heads=null", "data.source=a.txt,b.txt"])
    assert cfg.model.n_layers == 3 and isinstance(cfg.model.n_layers, int)
    assert cfg.optim.lr == 3e-4
    assert cfg.model.tie_embeddings is False
    assert cfg.seq_len == 32
    assert cfg.model.n_kv_heads is None and cfg.model.kv_heads == cfg.model.n_heads
    assert cfg.data.source == "a.txt,b.txt"


def test_layers_apply_in_order(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("model:\n  n_layers: 5\n  d_model: 128\ntrain:\n  max_steps: 7\n")
    cfg = make_config("tiny", path, ["model.n_layers=8"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.train.max_steps) == (8, 128, 7)
    assert cfg.model.vocab_size == MODEL_PRESETS["tiny"]["vocab_size"]  # preset kept where not overridden


def test_config_round_trips_through_yaml(tmp_path):
    cfg = make_config("llama3-8b", overrides=["train.max_steps=5", "optim.lr=1e-4"])
    # as a run's config.yaml is written (runs/state.py, runs/folders.py)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("override, message", [
    ("model.n_layer=8", "unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)"),
    ("trian.max_steps=3", "unknown config key 'trian.max_steps' (did you mean 'train.max_steps'?)"),
    ("model.n_layers=eight", "model.n_layers must be int, got 'eight'"),
    ("model.n_layers=0", "model.n_layers must be positive, got 0"),
    ("model.dropout=1.5", "model.dropout must be in [0, 1), got 1.5"),
    ("model.n_heads=3", "model.d_model (64) must be divisible by model.n_heads (3)"),
    ("model.n_kv_heads=3", "model.n_heads (4) must be a multiple of model.n_kv_heads (3)"),
    ("model.attention=flash", "model.attention must be one of naive, sdpa, flash_torch, flash_triton, auto, "
                               "got 'flash' (did you mean 'flash_torch'?)"),
    ("model.vocab_size=100", "model.vocab_size must be between 257"),
    ("train.seq_len=128", "train.seq_len (128) must not exceed model.max_seq_len (64)"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio must be in [0, 1], got 2.0"),
    ("optim.beta2=1.0", "optim.beta2 must be in [0, 1), got 1.0"),
    ("train.device=tpu", "train.device must be auto, cpu, cuda or cuda:N"),
    ("data.val_fraction=0.9", "data.val_fraction must be in (0, 0.5]"),
    ("max_steps", "overrides look like section.key=value"),
    # numbers that parse but no setting means: inf and nan, and finite ones beyond fp32
    ("optim.lr=inf", "optim.lr must be a finite number within fp32's range (|x| <= 3.4e38), got inf"),
    ("optim.eps=nan", "optim.eps must be a finite number within fp32's range (|x| <= 3.4e38), got nan"),
    ("optim.grad_clip=inf", "optim.grad_clip must be a finite number"),
    ("model.rope_theta=1e39", "model.rope_theta must be a finite number within fp32's range (|x| <= 3.4e38), "
                              "got 1e+39"),
    ("optim.lr=3.3e38", "optim.lr=3.3e+38 overflows fp32 in AdamW's first step (lr / (1 - beta1) > 3.4e38): "
                        "use a learning rate below 1"),
    ("optim.decay_steps=0", "optim.decay_steps must be positive, got 0"),
])
def test_bad_values_stop_with_one_clear_line(override, message):
    with pytest.raises(LmforgeError) as err:
        make_config("tiny", overrides=[override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(LmforgeError, match="did you mean 'gpt2-124m'"):
        make_config("gpt2-124")


@pytest.mark.parametrize("text, message", [
    ("model: [1, 2", "is not valid YAML"),
    ("- a\n- b\n", "must hold a mapping of sections"),
    ("model: 3\n", "'model' must be a section"),
    ("model:\n  width: 3\n", "unknown config key 'model.width'"),
])
def test_bad_yaml_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LmforgeError, match=message.replace("[", r"\[").replace("(", r"\(")):
        make_config("tiny", path)


def test_yaml_errors_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  n_layers: 3\n\td_model: 128\n")
    with pytest.raises(LmforgeError) as err:
        make_config("tiny", path)
    assert str(err.value) == (f"config file {path} is not valid YAML, line 3, column 1: "
                              f"found character '\\t' that cannot start any token")


def test_missing_config_file(tmp_path):
    with pytest.raises(LmforgeError, match="not found"):
        make_config("tiny", tmp_path / "nope.yaml")


def test_overflowing_learning_rates_stop_before_anything_is_written(tmp_path):
    """Issue 17.1: these ran a step (inf: every weight NaN) or ended in a traceback (3.3e38)."""
    for lr in ("inf", "3.3e38"):
        result = subprocess.run([sys.executable, "-m", "lmforge", "train", f"optim.lr={lr}", "optim.warmup_steps=0"],
                                capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("lmforge: error: optim.lr")
        assert list(tmp_path.iterdir()) == []


def test_the_schedule_length_is_fixed_when_a_config_is_made():
    assert make_config("tiny", overrides=["train.max_steps=70"]).optim.decay_steps == 70
    assert make_config("tiny", overrides=["train.max_steps=70", "optim.decay_steps=90"]).optim.decay_steps == 90


def test_absurd_settings_warn_when_training_starts(tiny_config, tmp_path, capsys):
    assert config_warnings(tiny_config(max_steps=8)) == []
    cfg = tiny_config("optim.lr=5", "optim.warmup_steps=8", max_steps=8)
    assert config_warnings(cfg) == [
        "optim.lr=5 is above 1: AdamW moves every weight by about lr per step, so training will most likely "
        "diverge (typical: 1e-4 to 1e-2)",
        "optim.warmup_steps=8 is not below train.max_steps=8: the whole run is warmup and the learning rate "
        "never decays"]
    assert config_warnings(tiny_config("optim.warmup_steps=6", "optim.decay_steps=5", max_steps=8)) == [
        "optim.warmup_steps=6 is not below optim.decay_steps=5: the learning rate never decays and stays at its "
        "peak after the warmup"]
    Trainer(cfg, tmp_path / "run", console=Console(quiet=True), progress=False)
    assert capsys.readouterr().err.splitlines() == [f"lmforge: warning: {line}" for line in config_warnings(cfg)]
