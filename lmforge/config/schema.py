"""The shape of a config: one dataclass per section, each field with its default and its meaning.

Which values a field may take is checked in validate.py; presets.py gives whole model sections.
"""

import dataclasses
from dataclasses import dataclass, field

from lmforge.modes import SHARDING

FAMILIES = ("llama", "gpt")  # model/transformer.py builds each (its FAMILIES table has these keys)
# model.rope_scaling's keys, as Hugging Face's config.json spells them (e.g. presets.LLAMA3_ROPE_SCALING)
ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Recipe switches (docs/recipe.md): the names model/init.py, model/transformer.py and optim/schedule.py build
INIT_SCHEMES = ("scaled_normal", "xavier", "kaiming")
MLPS = ("swiglu", "gelu", "relu2")
FAMILY_MLPS = {"llama": "swiglu", "gpt": "gelu"}  # the MLP each family builds when model.mlp is unset
LR_SCHEDULES = ("cosine", "wsd")
# optim.muon_adjust_lr: how Muon scales its rate by a matrix's shape (optim/muon.py)
MUON_ADJUST_LR = ("original", "match_rms_adamw")


@dataclass
class ModelConfig:
    # llama: RMSNorm, RoPE, SwiGLU, GQA, no biases | gpt: LayerNorm, learned positions, GELU, biases
    family: str = "llama"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    d_ff: int | None = None  # None: 8/3*d_model rounded up to a multiple of 64 (SwiGLU) or 4*d_model (GELU, ReLU^2)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # None, or Llama 3.1's long-context rescaling of the rotary frequencies: {rope_type: llama3, factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings} (ROPE_SCALING_KEYS;
    # model/attention.py, rope_frequencies)
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = True
    attention: str = "sdpa"
    # Architecture choices of the llama family, each realised by which modules are built
    # (model/transformer.py), never asked in a forward pass:
    d_head: int | None = None  # width of each attention head; None: d_model / n_heads (Qwen3 and Gemma set their own)
    qkv_bias: bool = False  # biases on the query, key and value projections, none on the output (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3)
    # each query sees itself and the sliding_window - 1 positions before it (Mistral); None: all before it
    sliding_window: int | None = None
    # Recipe switches (docs/recipe.md), each chosen when the model is built:
    init: str = "scaled_normal"  # INIT_SCHEMES: scaled_normal (GPT-2's) | xavier | kaiming (model/init.py)
    # zero the residual-stream projections (attention o_proj, MLP down_proj) and an untied LM head (modded-nanogpt)
    zero_init_proj: bool = False
    mlp: str | None = None  # swiglu | gelu | relu2 (Primer's ReLU^2, So et al. 2021); None: the family's (FAMILY_MLPS)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2); None: no cap

    @property
    def mlp_kind(self) -> str:
        return self.mlp or FAMILY_MLPS[self.family]

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp_kind != "swiglu":  # two matrices (GELU, ReLU^2): GPT-2's 4d
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
    # adamw | adam | sgd | sgd-momentum | adagrad | rmsprop | lion (modes/; docs/optimizers.md).
    # Their hyper-parameters below: lr, weight_decay and grad_clip apply to all; beta1 to adam(w) and
    # lion; beta2 to adam(w), lion and rmsprop (its alpha: the decay of the average of g^2); eps to
    # adam(w), adagrad and rmsprop; momentum and nesterov to sgd-momentum
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 50
    # steps from the start to the end of the cosine (lmforge/optim/schedule.py), after which the rate
    # stays at its floor; None: train.max_steps, fixed into the run's config.yaml when the run starts,
    # so that extending a run with a larger train.max_steps does not re-stretch the steps already taken
    decay_steps: int | None = None
    # matrices and embeddings only; decoupled (Loshchilov & Hutter 2019) for adamw and lion, an L2
    # term added to the gradient for the others (as their torch.optim counterparts)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    momentum: float = 0.9  # sgd-momentum: the momentum buffer's decay (mu, dampening 0)
    nesterov: bool = False  # sgd-momentum: Nesterov's momentum (Sutskever et al. 2013, eq. 3-4)
    # The schedule's shape (optim/schedule.py; docs/recipe.md): cosine, or warmup-stable-decay (Hägele et
    # al. 2024): the peak held, then a linear decay to the floor over the last decay_fraction of decay_steps
    schedule: str = "cosine"  # LR_SCHEDULES: cosine | wsd
    decay_fraction: float = 0.2  # wsd only
    # Muon (optim/muon.py), for the 2-D weights inside blocks; the rest takes AdamW's settings above.
    # Muon's peak rate: its groups multiply the scheduled rate by muon_lr / lr (Jordan et al. 2024: 0.02)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # original: lr * sqrt(max(1, out/in)) (Jordan) | match_rms_adamw: lr * 0.2 sqrt(max(out, in)) (Liu et al. 2025)
    muon_adjust_lr: str = "original"
    # Adafactor (optim/adafactor.py; torch.optim.Adafactor's defaults): the second-moment decay is
    # 1 - t^adafactor_beta2_decay, and an update's RMS is clipped to adafactor_clip_threshold
    adafactor_beta2_decay: float = -0.8
    adafactor_clip_threshold: float = 1.0


@dataclass
class TrainConfig:
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int | None = None  # None: model.max_seq_len
    max_steps: int = 900
    eval_interval: int = 100  # 0: evaluate only at the end
    eval_batches: int = 8
    # rows per validation batch, per data-parallel replica; None: batch_size. A batch's windows are the first
    # rows of a larger batch's: runs of different batch sizes are validated on the same windows only when
    # this is the same (bench/speedrun.py sets 8)
    eval_batch_size: int | None = None
    # the validation batches evaluated are drawn from this seed; None: train.seed + 1 (a fixed set across
    # seeds: bench/speedrun.py compares runs of several train.seed on the same batches)
    eval_seed: int | None = None
    # stop once an evaluation's val loss is <= this (bench/speedrun.py: time to a target); None: run to max_steps
    target_loss: float | None = None
    # multiple-choice tasks scored at each evaluation (lmforge eval's names or suites, e.g. "arc_easy,hellaswag";
    # "": none), on the first eval_items questions of each (train/evaluate.py; the data: make setup-eval)
    eval_tasks: str = ""
    eval_items: int = 50
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
    compile: bool = False  # torch.compile each block and the head + loss (wrap.py)
    # LM head + cross-entropy in chunks of this many tokens, never materialising the whole
    # (tokens x vocab) logits (wrap.py); 0: the plain loss
    loss_chunk_tokens: int = 0
    sample_tokens: int = 200  # tokens generated at the end of training; 0 disables
    sample_prompt: str = ""  # "": the start of a validation document (a prompt in the corpus's language)
    # a fit written by `lmforge scaling fit --out`: the plan and the summary set the final validation
    # loss beside the loss it predicts for this model and max_steps' tokens (accounting/scaling.py)
    scaling_fit: str | None = None
    # the summary's step time predicted by the roofline beside the measured, after the run, on the roof
    # `lmforge plan --roofline X.png` cached (never measured inside training: accounting/roofline/)
    roofline: bool = False
    tensorboard: bool = True  # TensorBoard event files in the run folder (tensorboard --logdir runs)
    wandb: bool = False  # also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)
    # data parallelism under torchrun (batch_size is per rank): none | ddp | zero1 | zero2 | zero3 | fsdp
    parallel: str = "none"
    bucket_mb: float = 25.0  # DDP/ZeRO: gradients are reduced in buckets of about this many MiB
    dist_timeout: int = 60  # seconds a collective may wait before the run stops (a dead rank)
    micro_batches: int = 1  # pipeline micro-batches per optimizer step, each of train.batch_size sequences
    # gpipe | 1f1b | interleaved-1f1b: the order in which each stage runs its forwards and backwards
    schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1  # interleaved-1f1b: model chunks per rank (v; the layers cut into p x v)
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
    adapter: str | None = None  # a PEFT LoRA adapter folder to continue training (its rank, alpha, targets)


@dataclass
class ParallelConfig:
    """Parallelism degrees other than train.parallel's data parallelism (docs/tensor-parallel.md)."""
    # tensor parallelism (Megatron-LM; lmforge/parallel/tp.py): ranks that split each layer's matrices;
    # the world is then (world / tp) data-parallel replicas of tp ranks each (parallel/mesh.py), the
    # replicas joined by train.parallel=ddp (or none: one replica)
    tp: int = 1
    # with tp: the residual stream, norms and biases after each region split along the sequence too
    # (Korthikanti et al. 2022, section 4.2.2): activations between the regions held 1/tp per rank
    sequence_parallel: bool = False
    # context parallelism (ring attention; lmforge/parallel/cp.py): ranks that split each sequence
    # (zig-zag); the world is then dp x cp x tp (parallel/mesh.py), gradients averaged by
    # train.parallel=ddp over the dp x cp ranks (docs/context-parallel.md)
    cp: int = 1
    # pipeline parallelism under torchrun (lmforge/parallel/pipeline/engine.py): the model cut into this many
    # stages, one per rank; with more ranks than stages, the pipelines are replicated (data parallel).
    # train.pipeline_stages, its older name, is read as an alias (config/load.py); 0 (older configs): 1
    pp: int = 1
    # the mesh's data-parallel degrees, torchtitan's names (Degrees below; 0: not set, inferred):
    # ranks that replicate the model and ranks that shard its states (> 1: train.parallel fsdp; both > 1:
    # hybrid sharding, HSDP); the world is then pp x dp_replicate x dp_shard x cp x tp (parallel/mesh.py)
    dp_replicate: int = 0
    dp_shard: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len


SECTIONS = ("model", "data", "optim", "train", "finetune", "parallel")  # Config's fields, in order


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# -- the parallel section's degrees: pp x dp_replicate x dp_shard x cp x tp (torchtitan's ParallelDims,
# torchtitan/distributed/parallel_dims.py, is the model: the same names and order, and a degree left
# unset inferred from the world size). validate.py's resolve_degrees turns the data-parallel degrees into
# the strategy the engines read; mesh_degrees gives the five degrees of a launch on a world of ranks
# (parallel/mesh.py builds the mesh from them). What the degrees do not combine with is config/rules.py's.

@dataclass(frozen=True)
class Degrees:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: the mesh gets separate dp_replicate and dp_shard dimensions."""
        return self.dp_replicate > 1 and self.dp_shard > 1


def mesh_degrees(cfg, world: int) -> Degrees:
    """The launch's five degrees on `world` ranks, those not given inferred (config/rules.py has
    already refused degrees that do not multiply to the world)."""
    p = cfg.parallel
    pp, cp, tp = p.pp, p.cp, p.tp
    if p.dp_replicate and p.dp_shard:
        return Degrees(pp, p.dp_replicate, p.dp_shard, cp, tp)
    dp = world // (pp * cp * tp)
    if p.dp_replicate:
        return Degrees(pp, p.dp_replicate, dp // p.dp_replicate, cp, tp)
    if p.dp_shard:
        return Degrees(pp, dp // p.dp_shard, p.dp_shard, cp, tp)
    sharding = cfg.train.parallel in SHARDING  # as before the degrees: a sharding strategy shards over every dp rank
    return Degrees(pp, 1 if sharding else dp, dp if sharding else 1, cp, tp)
