"""The names lmforge's settings choose among, torch-free: attention backends, optimizers, data-parallel
strategies and pipeline schedules, precision policies and recomputation modes, each with what the
rest of lmforge asks of it.

The one list of each (tests/test_registries.py checks that every other list of them is one of these
objects): config/validate.py validates the settings against them, accounting/ costs them, and the
torch side applies them (model/attention.py, optim/build.py, parallel/, precision/policy.py,
wrap.py). No torch here, so that parsing a config, `lmforge plan` and `lmforge --help`
do not load it (seconds on a busy machine).
"""

from dataclasses import dataclass

from lmforge.common.errors import LmforgeError, lookup


# -- attention backends (implemented in model/attention.py), and what accounting needs to know of each

@dataclass(frozen=True)
class Backend:
    name: str
    # One fused op computes softmax(Q K^T) V and keeps q, k, v, the output and an fp32
    # log-sum-exp per row for backward (Dao 2023): O(s) bytes, and a selective recomputation
    # reruns QK^T and AV both. False: the s x s probabilities are materialised and kept.
    fused: bool
    dropout: bool  # implements attention dropout
    description: str


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("naive", fused=False, dropout=True, description="materialises the s x s scores: the reference"),
    Backend("sdpa", fused=True, dropout=True, description="torch's scaled_dot_product_attention"),
    Backend("flash_torch", fused=True, dropout=False, description="FlashAttention-2 tile by tile in PyTorch"),
    Backend("flash_triton", fused=True, dropout=False, description="FlashAttention-2 as Triton kernels"),
    # every backend attention.resolve_backend picks for `auto` is fused and has dropout (today: sdpa)
    Backend("auto", fused=True, dropout=True, description="chosen per device at run time (sdpa)"),
)}
# The flash kernels would have to regenerate the dropout mask in backward; they do not.
FLASH_BACKENDS = tuple(name for name, backend in BACKENDS.items() if not backend.dropout)


# -- optimizers: the one list that `optim.name` (config/validate.py), the plan's `--optimizer`
# (accounting/memory.py, keyed by these names) and the trainer's builders (optim/build.py) share.
# A name the plan can cost but training cannot run (trained=False) is refused by validation with `why`.
# To add one: an entry here, its state count in accounting/memory.py and its builder in
# optim/build.py (tests/test_optimizers.py checks that the three agree).

@dataclass(frozen=True)
class OptimizerMode:
    name: str
    trained: bool  # optim/build.py builds it for `lmforge train`
    description: str
    why: str = ""  # not trained: what to use instead (one line for the user)


OPTIMIZER_MODES: dict[str, OptimizerMode] = {mode.name: mode for mode in (
    OptimizerMode("adamw", True, "Adam with decoupled weight decay (Loshchilov & Hutter 2019): the default"),
    OptimizerMode("adam", True, "Adam (Kingma & Ba 2015), weight decay as L2 in the gradient (torch.optim.Adam)"),
    OptimizerMode("sgd", True, "plain stochastic gradient descent, no state"),
    OptimizerMode("sgd-momentum", True, "SGD with heavy-ball or Nesterov momentum (optim.momentum, optim.nesterov)"),
    OptimizerMode("adagrad", True, "AdaGrad (Duchi et al. 2011): per-element rates from the summed squared gradients"),
    OptimizerMode("rmsprop", True, "RMSProp (Hinton 2012): per-element rates from a moving average of g^2"),
    OptimizerMode("lion", True, "Lion (Chen et al. 2023): the sign of interpolated momentum, one state"),
    OptimizerMode("adamw-8bit", False, "AdamW with block-wise 8-bit states (Dettmers et al. 2022)",
                  why="it needs bitsandbytes' 8-bit kernels, which lmforge does not implement; use adamw"),
    OptimizerMode("adafactor", True, "Adafactor (Shazeer & Stern 2018): factored second moment (ddp or one process)"),
    OptimizerMode("muon", True, "Muon (Jordan et al. 2024): orthogonalised momentum for the blocks' matrices, "
                                "AdamW for the rest (optim.muon_*)"),
)}
TRAINED_OPTIMIZERS = tuple(name for name, mode in OPTIMIZER_MODES.items() if mode.trained)


# -- data-parallel strategies: what each shards across the N_d ranks (Rajbhandari et al. 2020, ZeRO, fig. 1)

@dataclass(frozen=True)
class ParallelStrategy:
    name: str
    zero_stage: int  # 0: nothing sharded; 1: optimizer states; 2: + gradients; 3: + parameters
    description: str


PARALLEL_STRATEGIES: dict[str, ParallelStrategy] = {s.name: s for s in (
    ParallelStrategy("none", 0, "one process"),
    ParallelStrategy("ddp", 0, "replicate everything; all-reduce gradients in buckets during backward"),
    ParallelStrategy("zero1", 1, "shard optimizer states (and fp32 master weights)"),
    ParallelStrategy("zero2", 2, "shard optimizer states and gradients (reduce-scatter)"),
    ParallelStrategy("zero3", 3, "shard optimizer states, gradients and parameters (gather per block)"),
    ParallelStrategy("fsdp", 3, "PyTorch FSDP2 fully_shard per block: the production path"),
)}


# The named sets the rest of lmforge uses, derived here (tests/test_registries.py checks that every list
# of strategies outside modes/ is one of these objects)
SHARDING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage > 0)  # zero1-3, fsdp
REPLICATING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage == 0)  # none, ddp: whole states
DATA_PARALLEL = tuple(name for name in PARALLEL_STRATEGIES if name != "none")  # share the work of N ranks
# what a pipeline stage's replicas can use: a pipeline step runs one backward per micro-batch, and
# only a strategy that shards no more than the optimizer states communicates once a step
STAGE_REPLICAS = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage <= 1)  # none, ddp, zero1
PARAMETER_SHARDING = tuple(name for name, s in PARALLEL_STRATEGIES.items() if s.zero_stage == 3)  # zero3, fsdp


def names(choices) -> str:
    """'a, b or c': the names of a set, for a message."""
    choices = list(choices)
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)


def get_strategy(name: str) -> ParallelStrategy:
    return lookup(PARALLEL_STRATEGIES, name, "parallel strategy")


def shard_unit(name: str) -> str:
    """The unit a parameter is gathered and sharded with by ZeRO (parallel/zero.py) and counted
    with by accounting/comm.py: its block ("blocks.3" for "blocks.3.attn.q_proj.weight"), or
    "rest" (embeddings, final norm, head)."""
    parts = name.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "rest"


# -- pipeline parallelism (lmforge/parallel/pipeline/engine.py) -----------------------------------------

@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    description: str


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (
    # Huang et al. 2019: every micro-batch's forward, then every backward; m micro-batches of
    # activations alive on every stage at the turn
    PipelineSchedule("gpipe", "all forwards, then all backwards (GPipe)"),
    # Narayanan et al. 2021, section 2.2: after a warm-up, one forward then one backward; stage s keeps
    # at most p - s micro-batches of activations alive; the same bubble as GPipe
    PipelineSchedule("1f1b", "warm-up forwards, then one forward one backward (1F1B)"),
    # Narayanan et al. 2021, section 2.2.2: each rank holds train.pipeline_virtual_stages chunks (round
    # robin); the bubble shrinks v-fold, for v times the point-to-point traffic
    PipelineSchedule("interleaved-1f1b", "1F1B over v model chunks per rank (interleaved 1F1B)"),
)}

PIPELINE_ENGINES = {"lmforge": "our schedules on send/recv (parallel/pipeline/engine.py)",
                    "torch": "torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B"}


def parse_split(text: str, n_layers: int, stages: int) -> list[int] | None:
    """`train.pipeline_split` as layers per stage ("4,4,4,4" -> [4, 4, 4, 4]), checked against the
    model; None for "" (the split is then balanced by cost: accounting/pipeline.py)."""
    if stages > n_layers:
        raise LmforgeError(f"parallel.pp={stages} but the model has {n_layers} layers: each stage needs "
                           f"at least one; use at most {n_layers} stages")
    if not text.strip():
        return None
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        raise LmforgeError(f"train.pipeline_split={text!r} is not a list of layer counts: write e.g. "
                           f"\"{','.join(['2'] * stages)}\"") from None
    if len(split) != stages or sum(split) != n_layers or min(split) < 1:
        raise LmforgeError(f"train.pipeline_split={text} must give each of the {stages} stages at least one layer "
                           f"and {n_layers} layers in all (the model's model.n_layers)")
    return split


# -- precision policies: what each stores and computes in, and what that costs in bytes.
# precision/policy.py applies one (and says why each is what it is: Micikevicius et al. 2018 and 2022),
# accounting/ reads the bytes per element (memory.py) and the dtype of the matmul peak (plan/).
#
#    policy       parameters  grads  AdamW m, v  forward matmuls        loss scaling
#    fp32         fp32        fp32   fp32        fp32                   no
#    bf16-mixed   fp32        fp32   fp32        bf16 (autocast)        no
#    fp16-mixed   fp32        fp32   fp32        fp16 (autocast)        dynamic (precision/policy.py)
#    bf16-pure    bf16        bf16   bf16        bf16                   no
#    fp8          fp32        fp32   fp32        fp8 linears, rest bf16 no (per-tensor fp8 scales)

@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor a policy stores (accounting/memory.py)."""
    parameter: int  # the parameters the model holds
    gradient: int
    master: int  # a separate fp32 master copy of the weights (0: the parameters are the master)
    optimizer_state: int  # each optimizer state element (AdamW has two per parameter)
    compute: int  # matmul outputs and the attention tensors
    linear_input: int  # what a block's linear layer keeps of its input for the weight gradient
    weight_copy: int  # a cast of each block linear weight made in forward, kept for backward (0: none)
    head_weight_copy: int  # the same for the LM head's weight
    residual: int  # the residual stream: fp32 around autocast (the embedding output is fp32), else the parameters'
    fp8_scales: int = 0  # bytes of per-tensor scales each block linear keeps (fp8: input and weight)


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: str  # parameters, their gradients and the AdamW moments (a torch dtype's name)
    compute_dtype: str | None  # autocast dtype of the forward pass; None: no autocast
    matmul_dtype: str  # whose peak FLOP/s its matmuls run at (accounting/hardware.py's names)
    loss_scaling: bool  # dynamic loss scaling (fp16)
    fp8: bool  # the blocks' linear layers compute in fp8
    bytes: PrecisionBytes

    @property
    def autocast(self) -> bool:
        """Low precision by torch.autocast around fp32 parameters (and an fp32 residual stream)."""
        return self.compute_dtype is not None

    @property
    def lossy_updates(self) -> bool:
        """Parameters in 16 bits: small updates can round to nothing (worth counting)."""
        return self.param_dtype != "float32"


POLICIES: dict[str, Policy] = {policy.name: policy for policy in (
    Policy("fp32", "float32", None, "float32", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=4, linear_input=4, weight_copy=0, head_weight_copy=0,
                                residual=4)),
    # torch.autocast keeps fp32 parameters (they are the master weights, Micikevicius et al. 2018)
    # and casts each weight and each linear input to 16 bits per use; the casts live until backward.
    Policy("bf16-mixed", "float32", "bfloat16", "bfloat16", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                residual=4)),
    Policy("fp16-mixed", "float32", "float16", "float16", loss_scaling=True, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                residual=4)),
    # Everything in bfloat16, optimizer states included: half the model-state bytes of fp32.
    Policy("bf16-pure", "bfloat16", None, "bfloat16", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(2, 2, 0, 2, compute=2, linear_input=2, weight_copy=0, head_weight_copy=0,
                                residual=2)),
    # bf16-mixed, but each block linear keeps its weight and its input as 1-byte e4m3 with two fp32
    # scales (Micikevicius et al. 2022); the LM head stays in bf16 (precision/policy.py says why).
    Policy("fp8", "float32", "bfloat16", "float8", loss_scaling=False, fp8=True,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=1, weight_copy=1, head_weight_copy=2,
                                residual=4, fp8_scales=8)),
)}
# Short names `lmforge plan --precision` also takes.
PRECISION_ALIASES = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}

# fp8's per-tensor scaling recipes (precision/fp8.py).
FP8_SCALINGS = {
    "current": "the scale comes from this tensor's own amax",
    "delayed": "the scale comes from the largest amax of the last steps (Transformer Engine's default)",
}


def get_policy(name: str) -> Policy:
    """The policy `name` stands for (aliases resolved); UnknownName if there is none."""
    aliased = {alias: POLICIES[full] for alias, full in PRECISION_ALIASES.items()}
    return lookup({**POLICIES, **aliased}, name, "precision")


# -- activation recomputation modes (Chen et al. 2016; Korthikanti et al. 2022): what each reruns ------

@dataclass(frozen=True)
class RecomputeMode:
    name: str
    blocks: bool  # each block keeps only its input; backward reruns the block's forward first
    attention_cores: bool  # each attention core (q, k, v -> softmax(QK^T)V) keeps only q, k, v and reruns
    description: str


RECOMPUTE_MODES: dict[str, RecomputeMode] = {mode.name: mode for mode in (
    RecomputeMode("none", blocks=False, attention_cores=False, description="keep every activation"),
    # the attention core holds the s x s terms that dominate memory at long sequence length, for a
    # small share of the FLOPs (Korthikanti et al. 2022, section 4.2)
    RecomputeMode("selective", blocks=False, attention_cores=True, description="rerun each attention core"),
    RecomputeMode("full", blocks=True, attention_cores=False, description="rerun each block from its input"),
)}


def get_recompute(name: str) -> RecomputeMode:
    return lookup(RECOMPUTE_MODES, name, "recompute mode")
