"""Checking a config: `validate` stops at the first setting that cannot work, with one line that names
it and what is allowed; `config_warnings` lists the ones that can but are probably not meant.

Only the config is read here. What combines with what is config/rules.py's one table: validate asks
it for the refusals that hold whatever the launch; the rest (processes, devices, the product of the
parallel degrees) are checked when the run starts (parallel/world.py's check_launch).
"""

import dataclasses
import difflib
import math
import os

from lmforge.common.errors import LmforgeError, warn
from lmforge.config.rules import check_config
from lmforge.config.schema import (FAMILIES, INIT_SCHEMES, LR_SCHEDULES, MLPS, MUON_ADJUST_LR, ROPE_SCALING_KEYS,
                                   SECTIONS, Config, DataConfig, FinetuneConfig, ModelConfig, OptimConfig)
# The names a setting can take, each from its one registry (light modules: no torch)
from lmforge.modes import (BACKENDS, FP8_SCALINGS, OPTIMIZER_MODES, PARALLEL_STRATEGIES, PIPELINE_ENGINES,
                           PIPELINE_SCHEDULES, POLICIES, RECOMPUTE_MODES, REPLICATING)

# The model and optimizer compute in fp32 (or narrower): a setting beyond its range would become
# inf in the first step.
FP32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1  # torch's and numpy's integers: a larger count, size or seed overflows in them

MAX_TIMEOUT_SECONDS = 365 * 86400  # datetime.timedelta's own limit is 999,999,999 days

# Sizes beyond these are refused: each is 2x (layers) or 4x and more the largest published model's
# (Llama 3.1 405B: 126 layers, d_model 16384, d_ff 53248, 128k positions, 128256 tokens), and within
# them `lmforge plan` answers in about a second (it builds the model on the meta device, ~2 ms per
# block: accounting/shapes.py) and every product of two sizes stays far inside int64.
MODEL_SIZE_LIMITS = {"n_layers": 256, "d_model": 2**17, "d_ff": 2**19, "max_seq_len": 2**24,
                     # the BPE trainer (tokenizers) reserves ~70 bytes per token up front and aborts the
                     # process, uncatchably, when that fails: 2**32 tokens asked for 283 GB here
                     "vocab_size": 2**24}


# The settings whose range is theirs alone, checked before the rest (which divide by some of them):
# unset (None) passes. Each message names the key, the range and the value.
POSITIVE = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.d_ff",
            "model.max_seq_len", "model.rope_theta", "model.norm_eps", "model.d_head", "model.sliding_window",
            "model.logit_softcap", "data.prefetch", "optim.lr", "optim.decay_steps", "optim.eps", "optim.muon_lr",
            "optim.muon_ns_steps", "train.batch_size", "train.grad_accum", "train.seq_len", "train.max_steps",
            "train.eval_batches", "train.eval_batch_size", "train.eval_items", "train.keep_checkpoints",
            "train.log_interval", "train.max_bad_steps", "train.bucket_mb", "train.dist_timeout", "train.micro_batches",
            "train.pipeline_virtual_stages", "train.target_loss", "finetune.lora_alpha", "parallel.pp", "parallel.tp",
            "parallel.cp")
# numpy's generators take no negative seed (data/loader.py seeds one with train.seed)
AT_LEAST_ZERO = ("optim.warmup_steps", "optim.weight_decay", "train.seed", "train.eval_seed", "train.eval_interval",
                 "train.checkpoint_interval", "train.sample_tokens", "train.loss_chunk_tokens")
BELOW_ONE = ("model.dropout", "optim.momentum", "optim.beta1", "optim.beta2", "optim.muon_momentum",
             "finetune.lora_dropout")  # in [0, 1)
UP_TO_ONE = ("optim.min_lr_ratio", "optim.decay_fraction")  # in [0, 1]
BOOLEANS = ("model.qkv_bias", "model.qk_norm", "model.zero_init_proj", "optim.nesterov")  # YAML may give other types


def validate(cfg: Config) -> None:
    """Raise LmforgeError for the first setting that cannot work (see config_warnings for the
    ones that can but are probably not meant). First the parallel section's degrees are resolved
    (resolve_degrees: they may set train.parallel, said in a warning by one process of a launch)."""
    for note in resolve_degrees(cfg):
        if os.environ.get("RANK", "0") == "0":
            warn(note)
    _check_numbers(cfg)
    _check_ranges(cfg)
    _check_choices(cfg)
    _check_model(cfg.model)
    _check_data(cfg.data)
    _check_optim(cfg.optim)
    _check_train(cfg)
    _check_finetune(cfg.finetune)
    _require(cfg.train.device in ("auto", "cpu") or cfg.train.device.startswith("cuda"),  # the spelling only
             f"train.device must be auto, cpu, cuda or cuda:N, got {cfg.train.device!r}")
    check_config(cfg)  # settings fine one by one that do not combine, whatever the launch (config/rules.py)


# parallel.dp_shard=N > 1: the data-parallel ranks shard the model states: train.parallel none or ddp
# becomes fsdp (zero1-3 and fsdp stay); parallel.dp_replicate=N alone (> 1): they replicate: none becomes
# ddp; both > 1: hybrid sharding (HSDP; Zhao et al. 2023, "PyTorch FSDP", section 3.2.2): FSDP2 over a
# (dp_replicate, dp_shard) mesh, shards within a shard group, gradients all-reduced across the replicate groups
def resolve_degrees(cfg) -> list[str]:
    """Set train.parallel from parallel.dp_replicate and dp_shard; the changes made, one line each (for
    a warning); LmforgeError for a degree that is no whole number."""
    p, t = cfg.parallel, cfg.train
    for key in ("dp_replicate", "dp_shard"):
        value = getattr(p, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LmforgeError(f"parallel.{key} must be a whole number >= 1 (0: inferred), got {value!r}")
    notes = []
    if p.dp_shard > 1 and t.parallel in REPLICATING:
        notes.append(f"parallel.dp_shard={p.dp_shard} shards the model states over the data-parallel ranks: "
                     f"train.parallel={t.parallel} becomes fsdp")
        t.parallel = "fsdp"
    elif p.dp_replicate > 1 and p.dp_shard <= 1 and t.parallel == "none":
        notes.append(f"parallel.dp_replicate={p.dp_replicate} replicates the model: train.parallel=none "
                     f"becomes ddp")
        t.parallel = "ddp"
    return notes


def _did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the choice closest to a mistyped word, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise LmforgeError(message)


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _check_numbers(cfg: Config) -> None:
    """Every number of every section: nan and inf parse as floats, and no setting means them; an
    integer must fit in int64. The per-setting ranges follow."""
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float):
                _require(math.isfinite(value) and abs(value) <= FP32_MAX,
                         f"{section}.{f.name} must be a finite number within fp32's range (|x| <= 3.4e38), "
                         f"got {value}")
            elif isinstance(value, int) and not isinstance(value, bool):
                _require(abs(value) <= INT64_MAX, f"{section}.{f.name} must fit in 64 bits (|x| <= 2**63 - 1), "
                                                  f"got {value}")


def _check_ranges(cfg: Config) -> None:
    for keys, ok, allowed in ((POSITIVE, lambda v: v > 0, "positive"), (AT_LEAST_ZERO, lambda v: v >= 0, ">= 0"),
                              (BELOW_ONE, lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
                              (UP_TO_ONE, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")):
        for key in keys:
            value = _get(cfg, key)
            _require(value is None or ok(value), f"{key} must be {allowed}, got {value}")
    for key in BOOLEANS:
        _require(isinstance(_get(cfg, key), bool), f"{key} must be true or false, got {_get(cfg, key)!r}")


def _check_choices(cfg: Config) -> None:
    """The settings that name one of a registry's entries."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    for key, value, choices in (
            ("model.family", m.family, FAMILIES), ("model.attention", m.attention, BACKENDS),
            ("model.init", m.init, INIT_SCHEMES), ("model.mlp", m.mlp, MLPS),
            ("optim.name", o.name, OPTIMIZER_MODES), ("optim.schedule", o.schedule, LR_SCHEDULES),
            ("train.precision", t.precision, POLICIES), ("train.fp8_scaling", t.fp8_scaling, FP8_SCALINGS),
            ("train.recompute", t.recompute, RECOMPUTE_MODES), ("train.parallel", t.parallel, PARALLEL_STRATEGIES),
            ("train.schedule", t.schedule, PIPELINE_SCHEDULES),
            ("train.pipeline_engine", t.pipeline_engine, PIPELINE_ENGINES)):
        if value is None:  # model.mlp unset: the family's
            continue
        _require(value in choices, f"{key} must be one of {', '.join(choices)}, got {value!r}"
                                   f"{_did_you_mean(str(value), choices)}")


def _check_model(m: ModelConfig) -> None:
    _require(m.vocab_size >= 257, f"model.vocab_size must be between 257 (256 bytes + end token) "
                                  f"and 2**24, got {m.vocab_size}")
    for key, limit in MODEL_SIZE_LIMITS.items():
        value = getattr(m, key)
        _require(value is None or value <= limit, f"model.{key}={value} is beyond lmforge's limit of {limit:,} "
                                                  f"(docs/bad-input.md says why)")
    _require(m.d_head is not None or m.d_model % m.n_heads == 0,
             f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _require(m.n_heads % m.kv_heads == 0,
             f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.kv_heads})")
    _require(m.family != "llama" or m.head_dim % 2 == 0, f"rotary embeddings need an even head dimension, "
                                                         f"got a head dimension of {m.head_dim}")
    _require(m.family != "gpt" or m.kv_heads == m.n_heads, "model.n_kv_heads applies to the llama family only")
    if m.rope_scaling is not None:
        _check_rope_scaling(m)
    # the llama family's build-time choices (Qwen2's q/k/v biases, Qwen3's QK-norm, a head width of its
    # own, Mistral's sliding window: every attention backend implements the window, model/attention.py)
    _require(m.family == "llama" or not (m.qkv_bias or m.qk_norm or m.d_head or m.sliding_window),
             "model.qkv_bias, qk_norm, d_head and sliding_window apply to the llama family only "
             "(gpt has biases everywhere and d_model / n_heads wide heads)")


def _check_rope_scaling(m: ModelConfig) -> None:
    scaling = m.rope_scaling
    _require(m.family == "llama", "model.rope_scaling applies to the llama family only (rotary embeddings)")
    _require(scaling.get("rope_type") == "llama3",
             f"model.rope_scaling: rope_type {scaling.get('rope_type')!r} is not supported; "
             f"lmforge implements 'llama3' (Llama 3.1/3.2), or null for none")
    _require(set(scaling) == set(ROPE_SCALING_KEYS), f"model.rope_scaling needs exactly the keys "
                                                     f"{', '.join(ROPE_SCALING_KEYS)}, got {', '.join(scaling)}")
    numbers = {key: scaling[key] for key in ROPE_SCALING_KEYS[1:]}
    _require(all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                 for v in numbers.values()),
             f"model.rope_scaling: factor, low_freq_factor, high_freq_factor and "
             f"original_max_position_embeddings must be positive numbers, got {numbers}")
    _require(numbers["low_freq_factor"] < numbers["high_freq_factor"],
             f"model.rope_scaling: low_freq_factor ({numbers['low_freq_factor']}) must be below "
             f"high_freq_factor ({numbers['high_freq_factor']})")


def _check_data(d: DataConfig) -> None:
    _require(d.source.strip() != "", "data.source is empty: use 'stdlib' or paths to .txt/.jsonl files")
    _require(d.end_token != "", "data.end_token is empty: name the tokenizer's end-of-text token")
    _require(0.0 < d.val_fraction <= 0.5, f"data.val_fraction must be in (0, 0.5], got {d.val_fraction}")


def _check_optim(o: OptimConfig) -> None:
    _require(OPTIMIZER_MODES[o.name].trained, f"optim.name={o.name} is costed by the plan but not trained: "
                                              f"{OPTIMIZER_MODES[o.name].why}")
    _require(not o.nesterov or (o.name == "sgd-momentum" and o.momentum > 0),
             f"optim.nesterov=true applies to optim.name=sgd-momentum with optim.momentum > 0, "
             f"got optim.name={o.name}, optim.momentum={o.momentum:g}")
    # AdamW scales its first update by lr / (1 - beta1) (bias correction), a number it holds in fp32
    _require(o.lr / (1.0 - o.beta1) <= FP32_MAX, f"optim.lr={o.lr:g} overflows fp32 in AdamW's first step "
                                                 f"(lr / (1 - beta1) > 3.4e38): use a learning rate below 1")
    _require(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")
    _require(o.muon_adjust_lr in MUON_ADJUST_LR,
             f"optim.muon_adjust_lr={o.muon_adjust_lr}: use {' or '.join(MUON_ADJUST_LR)}")
    _require(o.adafactor_beta2_decay <= 0, f"optim.adafactor_beta2_decay must be <= 0, got {o.adafactor_beta2_decay}")
    _require(o.adafactor_clip_threshold >= 1,
             f"optim.adafactor_clip_threshold must be >= 1, got {o.adafactor_clip_threshold}")


def _check_train(cfg: Config) -> None:
    t = cfg.train
    # a timeout is a timedelta
    _require(t.dist_timeout <= MAX_TIMEOUT_SECONDS, f"train.dist_timeout must be at most {MAX_TIMEOUT_SECONDS:,} "
                                                    f"seconds (a year), got {t.dist_timeout}")
    _require(cfg.seq_len <= cfg.model.max_seq_len, f"train.seq_len ({cfg.seq_len}) must not exceed "
                                                   f"model.max_seq_len ({cfg.model.max_seq_len})")


def _check_finetune(f: FinetuneConfig) -> None:
    _require(f.lora_rank is None or f.lora_rank >= 1, f"finetune.lora_rank must be >= 1, got {f.lora_rank} "
                                                      f"(leave it out for full fine-tuning)")
    _require(f.lora_targets.strip(" ,") != "", "finetune.lora_targets is empty: name linear layers, e.g. q_proj,v_proj")
    _require(f.adapter is None or f.lora_rank is not None, "finetune.adapter continues a LoRA adapter: it needs "
                                                           "finetune.lora_rank (lmforge finetune --adapter sets it)")


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but most likely a mistake, one line each (for lmforge.common.errors.warn)."""
    o, t = cfg.optim, cfg.train
    found = []
    if o.lr > 1:
        found.append(f"optim.lr={o.lr:g} is above 1: AdamW moves every weight by about lr per step, "
                     f"so training will most likely diverge (typical: 1e-4 to 1e-2)")
    decay_steps = o.decay_steps or t.max_steps
    if o.warmup_steps >= t.max_steps:
        found.append(f"optim.warmup_steps={o.warmup_steps} is not below train.max_steps={t.max_steps}: "
                     f"the whole run is warmup and the learning rate never decays")
    elif o.warmup_steps >= decay_steps:
        found.append(f"optim.warmup_steps={o.warmup_steps} is not below optim.decay_steps={decay_steps}: "
                     f"the learning rate never decays and stays at its peak after the warmup")
    return found
