"""A plan: what a training setup will cost before it runs. FLOPs, memory per device, time.

Everything here is arithmetic on a ModelConfig, the shapes of its model (read from it built on
the meta device: shapes.py) and a few numbers (batch, sequence, precision, parallel degrees); it
imports no training code. `lmforge plan` prints it (show.py), and the trainer prints the same
plan before it starts and sets its measurements beside it at the end. The setup's precision name
is resolved once (Setup.policy) and the Policy handed to the formulas; a pipeline's stages are
counted in pipeline.py.
"""

from dataclasses import asdict, dataclass

from lmforge.accounting import comm, flops, memory
from lmforge.accounting.hardware import ACCELERATORS, DEFAULT_RESERVE_BYTES, accelerator_peak, check_hardware
from lmforge.accounting.optimizers import OPTIMIZERS
from lmforge.accounting.pipeline import rank_chunks, stage_communication
from lmforge.accounting.plan.context_parallel import (check_context_parallel, context_parallel_section, local_tokens,
                                                      ring_bytes_per_step, sequence_shards, shard_activations)
from lmforge.accounting.plan.pipeline import pipeline_plan, rank_parameters, stage_tensor_parallel
from lmforge.accounting.shapes import model_shapes, tensor_parallel_degrees
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes.attention import BACKENDS
from lmforge.modes.parallel import PIPELINE_SCHEDULES, get_strategy, parse_split
from lmforge.modes.precision import Policy, get_policy
from lmforge.modes.recompute import get_recompute


CHINCHILLA_TOKENS_PER_PARAMETER = 20


def matmul_dtype(precision: str) -> str:
    """The dtype whose peak FLOP/s a precision's matmuls are measured against (aliases allowed)."""
    return get_policy(precision).matmul_dtype


@dataclass
class Setup:
    batch_size: int = 8  # sequences per micro-batch, per data-parallel rank
    seq_len: int = 256
    grad_accum: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    zero_stage: int = 0
    parallel: str = "none"  # train.parallel (modes/parallel.py); "none" with zero_stage > 0 means that ZeRO stage
    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree
    sequence_parallel: bool = True  # with tp: norms and dropout split along the sequence (Korthikanti et al. 2022)
    pp: int = 1  # pipeline stages (train.pipeline_stages); devices = dp x cp x tp x pp
    cp: int = 1  # context-parallel degree (parallel.cp): each rank holds seq/cp tokens of every row (zig-zag)
    dp_replicate: int = 1  # > 1: hybrid sharding, dp = dp_replicate x dp_shard, states sharded over dp_shard
    micro_batches: int = 1  # pipeline micro-batches per optimizer step, each of batch_size sequences
    schedule: str = "1f1b"  # gpipe | 1f1b (modes/parallel.py's PIPELINE_SCHEDULES): how many are in flight
    pipeline_split: str = ""  # layers per stage, "4,4,4,4"; "": balanced by FLOPs (accounting/pipeline.py)
    virtual_stages: int = 1  # interleaved-1f1b: model chunks per stage (train.pipeline_virtual_stages)
    recompute: str = "none"
    attention: str = "sdpa"  # a name in modes/attention.py: naive keeps the s x s scores, the fused ones do not
    fp32_attention: bool = False  # the attention core in fp32 under a low-precision policy
    loss_chunk_tokens: int = 0  # head + loss in chunks of this many tokens (0: whole logits)
    hardware: str = "this"  # a name in hardware.ACCELERATORS, or "this" (peak and memory given below)
    mfu: float = 0.5  # the model FLOPs utilisation assumed for time estimates
    tokens: float | None = None  # the token budget for total time and cost (None: Chinchilla's 20 per parameter)
    price_per_hour: float | None = None  # per device-hour, for the cost of the token budget
    reserve_bytes: float = DEFAULT_RESERVE_BYTES  # kept free per device: CUDA context, fragmentation
    lora_rank: int | None = None  # LoRA adapters of this rank on a frozen base (None: every weight trains)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # the linear layers LoRA wraps (model/lora.py)
    bucket_mb: float = 25.0  # train.bucket_mb: DDP all-reduces its gradients in buckets of about this many MiB

    @property
    def policy(self) -> Policy:
        """The precision policy `precision` names (aliases resolved): what the formulas are given."""
        return get_policy(self.precision)

    @property
    def lora(self) -> tuple[int, str] | None:
        """(rank, targets) under LoRA, for the FLOP count; None for full training."""
        return None if self.lora_rank is None else (self.lora_rank, self.lora_targets)

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """The ranks the gradients are reduced over and ZeRO/FSDP shard over: dp x cp (each cp rank
        one more replica of its shard: parallel/cp_engine.py)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO/FSDP shard the states over: the data ranks, or one dp_shard group of
        them under hybrid sharding (parallel/mesh.py)."""
        return self.data_ranks // self.dp_replicate

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum * self.micro_batches * self.dp

    @classmethod
    def from_config(cls, cfg, **changes) -> "Setup":
        """The setup a Config trains with (one device), with `changes` applied."""
        values = dict(batch_size=cfg.train.batch_size, seq_len=cfg.seq_len, grad_accum=cfg.train.grad_accum,
                      precision=cfg.train.precision, optimizer=cfg.optim.name, recompute=cfg.train.recompute, attention=cfg.model.attention,
                      fp32_attention=cfg.train.fp32_attention, parallel=cfg.train.parallel,
                      zero_stage=get_strategy(cfg.train.parallel).zero_stage,
                      loss_chunk_tokens=cfg.train.loss_chunk_tokens, lora_rank=cfg.finetune.lora_rank,
                      lora_targets=cfg.finetune.lora_targets, pp=cfg.train.pipeline_stages,
                      micro_batches=cfg.train.micro_batches, schedule=cfg.train.schedule,
                      pipeline_split=cfg.train.pipeline_split, virtual_stages=cfg.train.pipeline_virtual_stages,
                      cp=cfg.parallel.cp, bucket_mb=cfg.train.bucket_mb)
        values.update({k: v for k, v in changes.items() if v is not None})
        return cls(**values)

    def validate(self, model: ModelConfig | None = None) -> None:
        """ValueError naming the first bad setting; with `model`, also what the setup needs of it."""
        def require(ok, message):
            if not ok:
                raise ValueError(message)
        for key in ("batch_size", "seq_len", "grad_accum", "dp", "tp", "pp", "cp", "micro_batches", "virtual_stages"):
            require(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        get_policy(self.precision)
        lookup(OPTIMIZERS, self.optimizer, "optimizer")
        require(self.zero_stage in (0, 1, 2, 3), f"zero stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        get_recompute(self.recompute)
        lookup(PIPELINE_SCHEDULES, self.schedule, "pipeline schedule")
        if self.pp > 1:  # what the pipeline engine (parallel/pipeline/engine.py) composes with
            require(self.zero_stage <= 1 and self.parallel in ("none", "ddp", "zero1"),
                    f"pp {self.pp} with {strategy_of(self)}: a pipeline's replicas run one backward per "
                    f"micro-batch, so ZeRO-2/3 and FSDP would communicate m times a step "
                    f"(parallel/pipeline/replicas.py); use zero stage 1 or 0")
            require(self.grad_accum == 1, f"grad_accum {self.grad_accum} with pp {self.pp}: a pipeline "
                                          f"accumulates over its micro-batches; set train.micro_batches instead")
        if self.dp_replicate > 1:  # hybrid sharding: FSDP2's 2-D mesh (config/degrees.py)
            require(self.dp % self.dp_replicate == 0 and strategy_of(self) == "fsdp" and self.cp == 1,
                    f"dp_replicate {self.dp_replicate} (hybrid sharding) needs FSDP, dp a multiple of it "
                    f"(dp {self.dp}) and cp 1")
        lookup(BACKENDS, self.attention, "attention backend")
        check_hardware(self.hardware)
        require(0 < self.mfu <= 1, f"mfu must be in (0, 1], got {self.mfu}")
        require(self.tokens is None or self.tokens > 0, f"tokens must be positive, got {self.tokens}")
        require(self.price_per_hour is None or self.price_per_hour >= 0,
                f"price per hour must be >= 0, got {self.price_per_hour}")
        require(self.reserve_bytes >= 0, f"reserve must be >= 0, got {self.reserve_bytes}")
        require(self.lora_rank is None or self.lora_rank >= 1, f"LoRA rank must be >= 1, got {self.lora_rank} "
                                                               f"(leave it out for full fine-tuning)")
        if model is not None and self.pp > 1:  # one line for more stages than layers, or a split that does not fit
            parse_split(self.pipeline_split, model.n_layers, self.pp)
            require(self.schedule == "interleaved-1f1b" or self.virtual_stages == 1,
                    f"{self.virtual_stages} virtual stages apply to the interleaved-1f1b schedule, not {self.schedule}")
            require(self.schedule != "interleaved-1f1b" or model.n_layers % (self.pp * self.virtual_stages) == 0,
                    f"pp {self.pp} x {self.virtual_stages} virtual stages = {self.pp * self.virtual_stages} equal "
                    f"chunks do not divide the {model.n_layers} layers")
        if self.cp > 1:
            check_context_parallel(self, model)
        if model is not None:  # tensor parallelism splits attention by whole heads
            fitting = tensor_parallel_degrees(model)
            require(self.tp in fitting, f"tp {self.tp} must divide the {model.n_heads} attention heads and divide "
                                        f"the {model.kv_heads} KV heads or be a multiple of them (each rank holds "
                                        f"whole heads): use one of {', '.join(map(str, fitting))}")


def strategy_of(setup: Setup) -> str:
    """The data-parallel strategy a setup names, or implies by its ZeRO stage and dp."""
    if setup.parallel != "none":
        return setup.parallel
    return f"zero{setup.zero_stage}" if setup.zero_stage else ("ddp" if setup.data_ranks > 1 else "none")


@dataclass
class Cost:
    """What a setup's step costs per device, before the plan lays it out."""
    breakdown: dict  # the plan's memory parts (memory.breakdown_bytes)
    activations: dict  # saved for backward, by part (memory.activation_breakdown_bytes)
    communication: dict  # sent per step per rank (comm.py's terms)
    step_seconds: float
    pipeline: dict | None = None  # plan["pipeline"] when pp > 1
    largest_shapes: tuple | None = None  # the parameters of the largest stage (None: the whole model)


def make_plan(cfg: ModelConfig, setup: Setup, this_machine: tuple[str, float, float] | None = None) -> dict:
    """The plan as a JSON-ready dict. `this_machine` = (name, peak FLOP/s, memory bytes) is needed
    when setup.hardware is "this" (the caller measures it; accounting stays pure). The step time
    from the roofline is opt-in, added by its callers (accounting/roofline/ops.py's predict_step)."""
    setup.validate(cfg)
    policy = setup.policy
    hardware_name, peak, device_memory = _hardware(setup, policy, this_machine)
    n_params = memory.parameter_count(cfg)
    lora = None
    if setup.lora_rank is not None:
        lora = memory.lora_parameters(cfg, setup.lora_rank, setup.lora_targets)
    step_flops = setup.tokens_per_step * flops.training_flops_per_token(cfg, setup.seq_len, lora=setup.lora)
    if setup.pp > 1:
        cost = _pipelined_cost(cfg, setup, policy, peak)
    else:
        cost = _single_stage_cost(cfg, setup, policy, lora, step_flops / (peak * setup.mfu * setup.devices))
    plan = {
        "model": {"family": cfg.family, "parameters": n_params, "matmul_parameters": model_shapes(cfg).matmul_weights,
                  "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads,
                  "ffn_dim": cfg.ffn_dim, "vocab_size": cfg.vocab_size},
        "setup": {**asdict(setup), "precision": policy.name, "devices": setup.devices,
                  "tokens_per_step": setup.tokens_per_step},
        "flops": _flops(cfg, setup, step_flops),
        "memory": _memory(cfg, setup, policy, cost, device_memory, n_params),
        "communication": cost.communication,
        **_time_and_budget(cfg, setup, policy, hardware_name, peak, cost.step_seconds, n_params),
    }
    if lora is not None:
        plan["lora"] = _lora(cfg, setup, policy, cost, lora, n_params)
    if cost.pipeline is not None:
        plan["pipeline"] = cost.pipeline
    if setup.cp > 1:
        plan["context_parallel"] = context_parallel_section(cfg, setup, step_flops)
    return plan


def _hardware(setup: Setup, policy: Policy, this_machine: tuple | None) -> tuple[str, float, float]:
    """(name, peak FLOP/s at the policy's matmul dtype, memory bytes) of setup.hardware."""
    if setup.hardware == "this":
        if this_machine is None:
            raise ValueError("hardware 'this' needs the measured (name, peak FLOP/s, memory bytes)")
        return this_machine
    return (setup.hardware, accelerator_peak(setup.hardware, policy.matmul_dtype),
            ACCELERATORS[setup.hardware].memory_bytes)


def _pipelined_cost(cfg: ModelConfig, setup: Setup, policy: Policy, peak: float) -> Cost:
    """Every stage counted on its own (plan/pipeline.py); a device holds the largest."""
    piped = pipeline_plan(cfg, setup, policy, peak * setup.mfu)
    largest = piped["stages_detail"][piped["largest_stage"]]
    first, held = (rank_parameters(cfg, setup, piped["split"], s) for s in (0, piped["largest_stage"]))
    layout = memory.sharded_layout(policy, setup.zero_stage)
    # rank 0's, as the trainer counts
    communication = stage_communication(first, setup.dp, layout, setup.zero_stage, setup.optimizer)
    if setup.tp > 1:
        layers = sum(map(len, rank_chunks(piped["split"], setup.pp, 0)))
        communication["tensor_parallel"] = stage_tensor_parallel(cfg, setup, layout, 0, layers)
    return Cost(largest["breakdown_bytes"], largest["activation_breakdown_bytes"], communication,
                piped["seconds_per_step"], piped, held.shapes)


def _single_stage_cost(cfg: ModelConfig, setup: Setup, policy: Policy, lora: int | None,
                       step_seconds: float) -> Cost:
    """The whole model on each device (split tp ways, sharded by ZeRO over dp)."""
    b, s = setup.batch_size, setup.seq_len
    held_lora = None if lora is None else memory.lora_parameters(cfg, setup.lora_rank, setup.lora_targets, setup.tp)
    states = memory.model_state_bytes(cfg, policy, setup.optimizer, setup.zero_stage, setup.shard_ranks, setup.tp,
                                      lora_trainable=held_lora, fully_shard=strategy_of(setup) == "fsdp")
    # the sharding engines compute on 16-bit working weights under a mixed policy: no weight casts
    layout = memory.sharded_layout(policy, get_strategy(strategy_of(setup)).zero_stage)
    if setup.cp > 1:  # this rank's zig-zag shard of every row (plan/context_parallel.py)
        activations, logits = shard_activations(cfg, setup, layout)
    else:
        activations = memory.activation_breakdown(cfg, b, s, layout, setup.attention, setup.recompute,
                                                  setup.tp, setup.fp32_attention, setup.loss_chunk_tokens,
                                                  setup.sequence_parallel)
        logits = memory.logits_bytes(cfg, b, s, policy, setup.loss_chunk_tokens) / setup.tp
    breakdown = {**states,
                 "weight_copies": activations.pop("weight_copies"),
                 "activations": sum(activations.values()),
                 "logits": logits}
    # with cp, each cp rank is one more replica to the gradient all-reduce (parallel/cp_engine.py)
    communication = comm.step_communication(cfg, strategy_of(setup), setup.shard_ranks, policy, setup.grad_accum,
                                            lora=setup.lora, tp=setup.tp, optimizer=setup.optimizer,
                                            replicate=setup.dp_replicate)
    if setup.tp > 1:  # the tensor ranks' activations (of this rank's tokens), besides the replicas' gradients
        tokens = local_tokens(s, setup.cp, sequence_shards(setup)) if setup.cp > 1 else s
        communication["tensor_parallel"] = comm.tensor_parallel_communication(
            cfg, b, tokens, setup.tp, setup.sequence_parallel, layout, setup.grad_accum, setup.optimizer,
            recompute=setup.recompute, lora=None if setup.lora_rank is None else (setup.lora_rank, setup.lora_targets))
    if setup.cp > 1:  # the ring's K/V and dK/dV (accounting/cp.py)
        communication["context_parallel"] = ring_bytes_per_step(cfg, setup, layout)
    return Cost(breakdown, activations, communication, step_seconds)


def _flops(cfg: ModelConfig, setup: Setup, step_flops: float) -> dict:
    s = setup.seq_len
    return {
        "forward_per_token_by_component": flops.forward_flops_breakdown(cfg, s),
        "training_per_token": flops.training_flops_per_token(cfg, s, lora=setup.lora),
        "training_per_token_causal_halved": flops.training_flops_per_token(cfg, s, causal=True, lora=setup.lora),
        "hardware_per_token": flops.hardware_flops_per_token(cfg, s, setup.recompute, lora=setup.lora),
        "six_n_per_token": flops.six_n_flops_per_token(cfg),
        "palm_per_token": flops.palm_flops_per_token(cfg, s),
        "training_per_step": step_flops,
    }


def _memory(cfg: ModelConfig, setup: Setup, policy: Policy, cost: Cost, device_memory: float, n_params: int) -> dict:
    """plan["memory"]: the cost's parts per device, whether they fit, and the papers' figures beside them."""
    b, s = setup.batch_size, setup.seq_len
    total = sum(cost.breakdown.values())
    # The paper's reference figure (standard attention, 16-bit), and its FlashAttention variant.
    korthikanti, korthikanti_flash = (
        memory.korthikanti_activation_bytes(s, b, cfg.d_model, cfg.n_heads, cfg.n_layers, setup.recompute, setup.tp,
                                            setup.sequence_parallel, flash=flash) for flash in (False, True))
    return {
        "per_device_bytes": total,
        "breakdown_bytes": cost.breakdown,
        "activation_breakdown_bytes": cost.activations,
        "device_memory_bytes": device_memory,
        "reserve_bytes": setup.reserve_bytes,
        "fits": total + setup.reserve_bytes <= device_memory,
        "kv_cache_inference_bytes": memory.kv_cache_bytes(cfg, b, s, policy.bytes.compute),
        "zero_paper_model_state_bytes": memory.zero_paper_model_state_bytes(n_params, setup.zero_stage,
                                                                            setup.shard_ranks),
        "activations_korthikanti_bytes": korthikanti,
        "activations_korthikanti_flash_bytes": korthikanti_flash,
        "parameters_16bit_bytes": 2 * n_params,
        "activations_to_16bit_parameters_ratio": korthikanti / (2 * n_params),
    }


def _time_and_budget(cfg: ModelConfig, setup: Setup, policy: Policy, hardware_name: str, peak: float,
                     step_seconds: float, n_params: int) -> dict:
    """plan["time"] and plan["budget"]: a step at the assumed MFU, and the token budget's time and cost."""
    # Without a budget, the compute-optimal one: about 20 training tokens per parameter (Hoffmann
    # et al. 2022, "Training Compute-Optimal Large Language Models", table 3).
    budget = setup.tokens or CHINCHILLA_TOKENS_PER_PARAMETER * n_params
    seconds_for_budget = budget / setup.tokens_per_step * step_seconds
    device_hours = seconds_for_budget * setup.devices / 3600
    time = {
        "hardware": hardware_name,
        "peak_flops_per_device": peak,
        "matmul_dtype": policy.matmul_dtype,
        "assumed_mfu": setup.mfu,
        "seconds_per_step": step_seconds,
        "tokens_per_second": setup.tokens_per_step / step_seconds,
        "tokens": budget,
        "tokens_source": "given" if setup.tokens else f"Chinchilla: {CHINCHILLA_TOKENS_PER_PARAMETER} tokens "
                                                      "per parameter (Hoffmann et al. 2022)",
        "seconds_for_tokens": seconds_for_budget,
    }
    return {"time": time, "budget": {
        "training_flops": budget * flops.training_flops_per_token(cfg, setup.seq_len, lora=setup.lora),
        "device_hours": device_hours,
        "price_per_device_hour": setup.price_per_hour,
        "cost": device_hours * setup.price_per_hour if setup.price_per_hour is not None else None,
    }}


def _lora(cfg: ModelConfig, setup: Setup, policy: Policy, cost: Cost, lora: int, n_params: int) -> dict:
    """plan["lora"]: what LoRA saves against training every weight: gradients, master copies and
    moments of the frozen base. Activations stay in the plan as for full fine-tuning: the gradient
    of an early adapter flows back through every later layer, which therefore keeps its inputs."""
    full = memory.model_state_bytes(cfg, policy, setup.optimizer, setup.zero_stage, setup.shard_ranks, setup.tp,
                                    parameter_shapes=cost.largest_shapes, fully_shard=strategy_of(setup) == "fsdp")
    return {"rank": setup.lora_rank, "targets": setup.lora_targets, "trainable_parameters": lora,
            "trainable_fraction": lora / n_params,
            "full_finetune_state_bytes": full,
            "saved_bytes": {key: full[key] - cost.breakdown[key] for key in full}}
