"""Configuration: dataclasses with defaults, named model presets, YAML files and `key=value` overrides.

A config is built in layers, each overriding the last:
    defaults  ->  model preset (`--model NAME`)  ->  YAML file (`--config F`)  ->  `section.key=value`
and then validated, so every bad value stops with one line that names it and what is allowed.
"""

import copy
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmforge.common.errors import LmforgeError
# The names a setting can take, each from its one registry (light modules: no torch)
from lmforge.modes.attention import BACKENDS
from lmforge.modes.precision import FP8_SCALINGS, POLICIES
from lmforge.modes.parallel import PARALLEL_STRATEGIES, PIPELINE_ENGINES, PIPELINE_SCHEDULES, parse_split
from lmforge.modes.recompute import RECOMPUTE_MODES

FAMILIES = ("llama", "gpt")  # model/transformer.py builds each (its FAMILIES table has these keys)


@dataclass
class ModelConfig:
    family: str = "llama"  # llama: RMSNorm, RoPE, SwiGLU, GQA, no biases | gpt: LayerNorm, learned positions, GELU, biases
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    d_ff: int | None = None  # None: 4*d_model (gpt) or 8/3*d_model rounded up to a multiple of 64 (llama)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # None, or Llama 3.1's long-context rescaling of the rotary frequencies, keyed as Hugging Face's
    # config.json keys it: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (model/transformer.py, rope_frequencies)
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = True
    attention: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.family == "gpt":
            return 4 * self.d_model
        # SwiGLU has three matrices instead of two; 2/3 of 4d keeps the parameter count of a
        # 4d GELU MLP (Shazeer 2020, section 2), rounded up for matmul-friendly shapes.
        return -(-(8 * self.d_model // 3) // 64) * 64


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib" (this Python's standard library) or comma-separated .txt/.jsonl files/folders
    dir: str | None = None  # where prepared token files live; None: data/<source>-bpe<vocab_size>
    val_fraction: float = 0.05  # fraction of documents held out for validation
    prefetch: int = 4  # batches prepared ahead by the loader thread
    # the tokenizer's token that ends each document and starts an empty prompt: lmforge's own tokenizers
    # have <|endoftext|>; a model imported from Hugging Face keeps its own (Llama 3: <|end_of_text|>)
    end_token: str = "<|endoftext|>"


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 50
    # steps from the start to the end of the cosine (lmforge/optim/schedule.py), after which the rate
    # stays at its floor; None: train.max_steps, fixed into the run's config.yaml when the run starts,
    # so that extending a run with a larger train.max_steps does not re-stretch the steps already taken
    decay_steps: int | None = None
    weight_decay: float = 0.1  # decoupled (Loshchilov & Hutter 2019); matrices and embeddings only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclass
class TrainConfig:
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int | None = None  # None: model.max_seq_len
    max_steps: int = 900
    eval_interval: int = 100  # 0: evaluate only at the end
    eval_batches: int = 8
    checkpoint_interval: int = 300  # 0: checkpoint only at the end
    keep_checkpoints: int = 2
    log_interval: int = 10
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16-mixed | fp16-mixed | bf16-pure | fp8
    fp32_attention: bool = False  # keep the attention core (scores, softmax, P V) in fp32 under low precision
    fp8_scaling: str = "current"  # fp8 per-tensor scales: current (this tensor's amax) | delayed (amax history)
    max_bad_steps: int = 1  # stop after this many non-finite steps in a row (all policies but fp16-mixed)
    recompute: str = "none"  # none | selective | full: activation recomputation in backward
    compile: bool = False  # torch.compile each block and the head + loss (train/compile.py)
    # LM head + cross-entropy in chunks of this many tokens, never materialising the whole
    # (tokens x vocab) logits (train/chunked_loss.py); 0: the plain loss
    loss_chunk_tokens: int = 0
    sample_tokens: int = 200  # tokens generated at the end of training; 0 disables
    sample_prompt: str = ""  # "": the start of a validation document (a prompt in the corpus's language)
    tensorboard: bool = True  # TensorBoard event files in the run folder (tensorboard --logdir runs)
    wandb: bool = False  # also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)
    # data parallelism under torchrun (batch_size is per rank): none | ddp | zero1 | zero2 | zero3 | fsdp
    parallel: str = "none"
    bucket_mb: float = 25.0  # DDP/ZeRO: gradients are reduced in buckets of about this many MiB
    dist_timeout: int = 60  # seconds a collective may wait before the run stops (a dead rank)
    # pipeline parallelism under torchrun (lmforge/parallel/pipeline.py): the model cut into this many
    # stages, one per rank; with more ranks than stages, the pipelines are replicated (data parallel)
    pipeline_stages: int = 1
    micro_batches: int = 1  # pipeline micro-batches per optimizer step, each of train.batch_size sequences
    schedule: str = "1f1b"  # gpipe | 1f1b: the order in which each stage runs its forwards and backwards
    pipeline_split: str = ""  # layers per stage, e.g. "4,4,4,4"; "": balanced by each layer's FLOPs
    pipeline_engine: str = "lmforge"  # lmforge: our schedules | torch: torch.distributed.pipelining's


@dataclass
class FinetuneConfig:
    """`lmforge finetune`: the base model and, with a LoRA rank, the adapters (model/lora.py)."""
    base: str | None = None  # the model fine-tuned: an lmforge run folder; None: trained from scratch
    lora_rank: int | None = None  # None: full fine-tuning (every weight trains)
    lora_alpha: float | None = None  # the update is scaled by alpha / rank; None: 2 * rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # linear layers by name pattern (fnmatch), comma-separated


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len


# Llama 3.1's rotary rescaling as its released config.json gives it (Llama 3.2 1B/3B: factor 32)
LLAMA3_ROPE_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)
ROPE_SCALING_KEYS = tuple(LLAMA3_ROPE_SCALING)

# Published shapes. The large ones are for planning; training them here is not the point.
MODEL_PRESETS: dict[str, dict] = {
    # For tests: trains in seconds.
    "tiny": dict(family="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 max_seq_len=64),
    # The default of `lmforge train`: about 8 minutes on a 2-core CPU (bench/RESULTS.md).
    "small": dict(family="llama", vocab_size=4096, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2,
                  max_seq_len=256),
    # Radford et al. 2019 (GPT-2), table 2; context 1024, vocabulary 50257, tied embeddings.
    "gpt2-124m": dict(family="gpt", vocab_size=50257, d_model=768, n_layers=12, n_heads=12,
                      max_seq_len=1024),
    "gpt2-350m": dict(family="gpt", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16,
                      max_seq_len=1024),
    # Brown et al. 2020 (GPT-3), table 2.1: 96 layers, d_model 12288, 96 heads, context 2048.
    "gpt3-175b": dict(family="gpt", vocab_size=50257, d_model=12288, n_layers=96, n_heads=96,
                      max_seq_len=2048),
    # Llama 3.2 1B (Meta model card / released config): tied embeddings, rope_theta 5e5.
    "llama3-1b": dict(family="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                      n_kv_heads=8, d_ff=8192, max_seq_len=8192, rope_theta=500000.0,
                      rope_scaling=dict(LLAMA3_ROPE_SCALING, factor=32.0)),
    # Touvron et al. 2023 (Llama 2), table 1 and released config.
    "llama2-7b": dict(family="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=32, d_ff=11008, max_seq_len=4096, tie_embeddings=False),
    # Dubey et al. 2024 (The Llama 3 Herd of Models), table 3.
    "llama3-8b": dict(family="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                      tie_embeddings=False),
    "llama3-70b": dict(family="llama", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, d_ff=28672, max_seq_len=8192, rope_theta=500000.0,
                       tie_embeddings=False),
}
DEFAULT_PRESET = "small"
SECTIONS = ("model", "data", "optim", "train", "finetune")


def make_config(preset: str | None = DEFAULT_PRESET, path: str | Path | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the preset, then the YAML file, then `section.key=value` overrides; validated."""
    cfg = Config()
    if preset is not None:
        if preset not in MODEL_PRESETS:
            raise LmforgeError(f"unknown model preset {preset!r}{_did_you_mean(preset, MODEL_PRESETS)}; "
                               f"presets: {', '.join(MODEL_PRESETS)}")
        cfg.model = ModelConfig(**copy.deepcopy(MODEL_PRESETS[preset]))  # its rope_scaling is the user's to change
    if path is not None:
        apply_dict(cfg, read_yaml(path), origin=str(path))
    for item in overrides:
        key, value = parse_override(item)
        set_value(cfg, key, value, origin="command line")
    validate(cfg)
    if cfg.optim.decay_steps is None:  # a new config: the schedule's length is fixed now (see OptimConfig)
        cfg.optim.decay_steps = cfg.train.max_steps
    return cfg


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise LmforgeError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise LmforgeError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise LmforgeError(f"config file {path} must hold a mapping of sections (model, data, optim, train)")
    return data


def apply_dict(cfg: Config, data: dict, origin: str) -> None:
    """Apply a nested {section: {key: value}} mapping, as read from YAML."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise LmforgeError(f"{origin}: {section!r} must be a section holding key: value pairs")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value, origin=origin)


def parse_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise LmforgeError(f"cannot read {item!r}: overrides look like section.key=value, e.g. train.max_steps=100")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def set_value(cfg: Config, key: str, value, origin: str) -> None:
    """Set `section.key` on cfg, converting `value` to the field's type."""
    all_keys = [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))]
    if key not in all_keys:
        raise LmforgeError(f"{origin}: unknown config key {key!r}{_did_you_mean(key, all_keys)}")
    section, name = key.split(".")
    target = getattr(cfg, section)
    hint = typing.get_type_hints(type(target))[name]
    setattr(target, name, _coerce(value, hint, key))


def _coerce(value, hint, key: str):
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    text = value.strip().lower() if isinstance(value, str) else None
    if type(None) in allowed and (value is None or text in ("none", "null", "~")):
        return None
    if bool in allowed:
        if isinstance(value, bool):
            return value
        if text in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return text in ("true", "yes", "on", "1")
    if int in allowed:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            pass
    if float in allowed:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(str(value))
        except ValueError:
            pass
    if dict in allowed:  # a YAML mapping, or one typed on the command line: key={a: 1, b: 2}
        parsed = yaml.safe_load(value) if isinstance(value, str) else value
        if isinstance(parsed, dict):
            return parsed
    if str in allowed and not isinstance(value, (dict, list, bool)):
        return str(value)
    if str in allowed and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a YAML list of paths for data.source
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise LmforgeError(f"{key} must be {names}, got {value!r}")


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# The model and optimizer compute in fp32 (or narrower): a setting beyond its range would become
# inf in the first step.
FP32_MAX = 3.4028234663852886e38


def validate(cfg: Config) -> None:
    """Raise LmforgeError for the first setting that cannot work (see config_warnings for the
    ones that can but are probably not meant)."""
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise LmforgeError(message)

    for section in SECTIONS:  # nan and inf parse as floats; no setting means them
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float):
                require(math.isfinite(value) and abs(value) <= FP32_MAX,
                        f"{section}.{f.name} must be a finite number within fp32's range (|x| <= 3.4e38), "
                        f"got {value}")

    def choose(key: str, value, choices) -> None:
        require(value in choices, f"{key} must be one of {', '.join(choices)}, got {value!r}"
                                  f"{_did_you_mean(str(value), choices)}")

    def positive(key: str, value) -> None:
        require(value is None or value > 0, f"{key} must be positive, got {value}")

    choose("model.family", m.family, FAMILIES)
    choose("model.attention", m.attention, BACKENDS)
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
                "rope_theta", "norm_eps"):
        positive(f"model.{key}", getattr(m, key))
    require(257 <= m.vocab_size <= 2**32, f"model.vocab_size must be between 257 (256 bytes + end token) "
                                          f"and 2**32, got {m.vocab_size}")
    require(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    require(m.n_heads % m.kv_heads == 0, f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.kv_heads})")
    require(m.family != "llama" or m.head_dim % 2 == 0, f"rotary embeddings need an even head dimension, "
                                                        f"got d_model/n_heads = {m.head_dim}")
    require(m.family != "gpt" or m.kv_heads == m.n_heads, "model.n_kv_heads applies to the llama family only")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m)
    require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")

    require(d.source.strip() != "", "data.source is empty: use 'stdlib' or paths to .txt/.jsonl files")
    require(d.end_token != "", "data.end_token is empty: name the tokenizer's end-of-text token")
    require(0.0 < d.val_fraction <= 0.5, f"data.val_fraction must be in (0, 0.5], got {d.val_fraction}")
    positive("data.prefetch", d.prefetch)

    positive("optim.lr", o.lr)
    require(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    positive("optim.decay_steps", o.decay_steps)
    require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    for key in ("beta1", "beta2"):
        require(0.0 <= getattr(o, key) < 1.0, f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    # AdamW scales its first update by lr / (1 - beta1) (bias correction), a number it holds in fp32
    require(o.lr / (1.0 - o.beta1) <= FP32_MAX, f"optim.lr={o.lr:g} overflows fp32 in AdamW's first step "
                                                f"(lr / (1 - beta1) > 3.4e38): use a learning rate below 1")
    positive("optim.eps", o.eps)
    require(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")

    for key in ("batch_size", "grad_accum", "seq_len", "max_steps", "eval_batches", "keep_checkpoints",
                "log_interval", "max_bad_steps", "bucket_mb", "dist_timeout", "pipeline_stages", "micro_batches"):
        positive(f"train.{key}", getattr(t, key))
    for key in ("eval_interval", "checkpoint_interval", "sample_tokens", "loss_chunk_tokens"):
        require(getattr(t, key) >= 0, f"train.{key} must be >= 0, got {getattr(t, key)}")
    require(cfg.seq_len <= m.max_seq_len, f"train.seq_len ({cfg.seq_len}) must not exceed model.max_seq_len "
                                          f"({m.max_seq_len})")
    choose("train.precision", t.precision, POLICIES)
    choose("train.fp8_scaling", t.fp8_scaling, FP8_SCALINGS)
    choose("train.recompute", t.recompute, RECOMPUTE_MODES)
    choose("train.parallel", t.parallel, PARALLEL_STRATEGIES)
    choose("train.schedule", t.schedule, PIPELINE_SCHEDULES)
    choose("train.pipeline_engine", t.pipeline_engine, PIPELINE_ENGINES)
    if t.pipeline_stages > 1 or t.pipeline_split:
        parse_split(t.pipeline_split, m.n_layers, t.pipeline_stages)  # raises on a split that does not fit
    require(t.pipeline_stages > 1 or t.micro_batches == 1,
            f"train.micro_batches={t.micro_batches} applies to pipelines (train.pipeline_stages > 1); "
            f"to accumulate gradients over micro-batches in one process use train.grad_accum")
    require(t.pipeline_stages == 1 or t.grad_accum == 1,
            f"train.grad_accum={t.grad_accum} with train.pipeline_stages={t.pipeline_stages}: a pipeline "
            f"accumulates over its micro-batches; set train.micro_batches instead")
    # the Triton kernels under torch.compile have never run (no GPU here): not offered untried
    require(not (t.compile and m.attention == "flash_triton"),
            "train.compile=true with model.attention=flash_triton is untested (its Triton kernels have never "
            "been traced by torch.compile): use model.attention=sdpa or train.compile=false")
    f = cfg.finetune
    require(f.lora_rank is None or f.lora_rank >= 1, f"finetune.lora_rank must be >= 1, got {f.lora_rank} "
                                                     f"(leave it out for full fine-tuning)")
    positive("finetune.lora_alpha", f.lora_alpha)
    require(0.0 <= f.lora_dropout < 1.0, f"finetune.lora_dropout must be in [0, 1), got {f.lora_dropout}")
    require(f.lora_targets.strip(" ,") != "", "finetune.lora_targets is empty: name linear layers, e.g. q_proj,v_proj")
    require(t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
            f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")


def _validate_rope_scaling(m: ModelConfig) -> None:
    scaling = m.rope_scaling
    if m.family != "llama":
        raise LmforgeError("model.rope_scaling applies to the llama family only (rotary embeddings)")
    if scaling.get("rope_type") != "llama3":
        raise LmforgeError(f"model.rope_scaling: rope_type {scaling.get('rope_type')!r} is not supported; "
                           f"lmforge implements 'llama3' (Llama 3.1/3.2), or null for none")
    if set(scaling) != set(ROPE_SCALING_KEYS):
        raise LmforgeError(f"model.rope_scaling needs exactly the keys {', '.join(ROPE_SCALING_KEYS)}, "
                           f"got {', '.join(scaling)}")
    numbers = {key: scaling[key] for key in ROPE_SCALING_KEYS[1:]}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in numbers.values()):
        raise LmforgeError(f"model.rope_scaling: factor, low_freq_factor, high_freq_factor and "
                           f"original_max_position_embeddings must be positive numbers, got {numbers}")
    if not numbers["low_freq_factor"] < numbers["high_freq_factor"]:
        raise LmforgeError(f"model.rope_scaling: low_freq_factor ({numbers['low_freq_factor']}) must be below "
                           f"high_freq_factor ({numbers['high_freq_factor']})")


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


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict, origin: str) -> Config:
    cfg = Config()
    apply_dict(cfg, data, origin=origin)
    validate(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def load_config(path: str | Path) -> Config:
    return config_from_dict(read_yaml(path), origin=str(path))
