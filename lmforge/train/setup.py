"""One place where a training setup is built: the model for one device, then everything that wraps
it from outside, in a fixed order, then the optimizer over what is trainable.

    1. build      Transformer(cfg) on `device` (or on the meta device: shapes only, no memory),
                  with the weights of a base model when fine-tuning
    1b. tensor    with parallel.tp > 1: each linear, the embedding and the LM head swapped for this
                  rank's slice of it, the loss for the vocabulary-parallel one (parallel/tp.py),
                  cut from the whole model built on the CPU, then moved to the device. First, so
                  that every later step wraps the split modules as it wraps whole ones, and the
                  weights are one process's (the same seed, the same model)
    1c. context   with parallel.cp > 1: each attention core swapped for ring attention over the cp
                  group, positions for the shard's, the loss for the group's, and a forward
                  pre-hook that cuts each whole batch to this rank's zig-zag shard
                  (parallel/cp_model.py); the engine (ddp, zero1-3, fsdp) runs over the dp x cp
                  ranks (parallel/engine.py).
                  After 1b on a tensor-parallel model: the ring runs on each tp rank's heads and
                  the group's loss sums the vocabulary-parallel cross-entropy (tp x cp)
    2. precision  parameter dtype, fp8 linears (module swap), fp32 attention core (wrapper module)
                  (precision/policy.py); on a tensor-parallel model fp8 swaps the split linears for
                  their fp8 forms, each scale the whole tensor's amax (parallel/tp_fp8.py)
    3. recompute  selective: each attention core in a Recompute wrapper; full: each block
                  (wrap.py)
    4. loss       the chunked head + loss in place of the plain one (wrap.py)
    5. LoRA       with finetune.lora_rank: freeze everything, wrap the targeted linears in
                  LoRALinear (model/lora.py); tensor-parallel ones in its split forms, adapters
                  drawn whole as one process draws them, then sliced (parallel/tp_lora.py)
    5b. cut       a pipeline stage keeps its blocks (and the embedding, or the head) of the model
                  built whole on the CPU, then moves to its device (parallel/pipeline/layout.py)
    6. compile    each block and the loss piece in a torch.compile wrapper (wrap.py)
    7. parallel   pipeline parallelism: the stage's engine (its schedule, point-to-point sends);
                  data parallelism: `parallelize` wraps the model in the engine of train.parallel
                  (lmforge/parallel/): none and ddp keep the model whole; zero1-3 flatten each
                  block's parameters (and the rest's) into per-unit buffers sharded over the ranks,
                  under the mixed policies 16-bit working copies with fp32 master shards; fsdp
                  applies fully_shard per block, then to the whole model. Hooks on the blocks (or on
                  their wrappers) gather and free stage-3 parameters, so recomputation and fp8 run
                  inside them.
    8. optimizer  optim.name's (optim/build.py; AdamW by default), decay on matrices and embeddings
                  only, built by the engine over what it updates: the parameters, or for ZeRO this
                  rank's slices of them

The order matters: recomputation wraps what precision produced (an fp32-attention core is
recomputed as a whole, casts included); compile traces the finished blocks, recomputation and
adapters included, and comes before data parallelism (torchtitan's order: activation
checkpointing, compile, FSDP); parallelism wraps the finished model (its hooks must see the final
modules and parameters), and the optimizer sees what parallelism left to update. Each step is a
module swap, an nn.Module wrapper or hooks, and refuses to run twice.

LoRA comes after precision and recomputation, not before:
  - after precision, the adapters are created after the policy has set the parameter dtype, so
    they stay fp32 (they are what trains) while a bf16-pure base is stored in bf16; fp8 swaps only
    the base linears (LoRALinear is looked into, not replaced), so the rank-r matmuls, too narrow
    to gain from fp8, stay in the autocast dtype;
  - recomputation wraps whole blocks or attention cores, which contain the linears: an adapter
    placed inside a recomputed block afterwards is recomputed with it, so nothing is lost by
    wrapping later, and names stay canonical either way (both wrappers drop their segment);
  - before compile (which traces the adapters with the block) and data parallelism, which must see
    the final set of trainable parameters (it reduces the gradients of those alone).
"""

import os
from pathlib import Path

import torch
import torch.nn as nn

from lmforge.config import Config
from lmforge.data.loader import check_windows
from lmforge.data.prepare import data_dir_of, open_run_data, prepare_data
from lmforge.common.errors import LmforgeError
from lmforge.kernels import flash_triton
from lmforge.modes import FLASH_BACKENDS, Policy, get_policy
from lmforge.interop.peft import load_peft_weights
from lmforge.model.lora import apply_lora
from lmforge.model.transformer import Transformer, meta_model
from lmforge.optim.build import make_optimizer, param_groups
from lmforge.parallel.cp_model import apply_context_parallel
from lmforge.parallel.parallelize import Engine, parallelize, pipeline_engine, run_groups
from lmforge.parallel.pipeline.layout import cut_stage, pipeline_place
from lmforge.parallel.tp import apply_tensor_parallel
from lmforge.parallel.tp_fp8 import apply_tensor_parallel_fp8
from lmforge.parallel.tp_lora import apply_tensor_parallel_lora
from lmforge.parallel.world import World
from lmforge.precision.policy import prepare_model
from lmforge.wrap import apply_chunked_loss, apply_compile, apply_recompute


def build_model(cfg: Config, policy: Policy, device: torch.device | str = "cpu",
                base_state: dict[str, torch.Tensor] | None = None, stage=None, tp_comm=None,
                cp_group=None) -> nn.Module:
    """The model of `cfg` on `device`, wrapped for training (steps 1-6 above) under `policy`
    (cfg.train.precision's, resolved once by the caller). On the meta device
    nothing is allocated: parameter shapes and the module tree only, in milliseconds even for 70B.
    Elsewhere the weights are initialised on the CPU and moved, so that a seed gives the same
    initial model on every device; `base_state` (a fine-tuning base, by parameter name) replaces them.
    `stage` = (layers, first, last): a pipeline stage, cut from the whole model after step 5 (so
    that its weights and adapters are those of one process: parallel/pipeline/layout.py).
    `tp_comm`: the Collectives of this rank's tensor-parallel group (step 1b); `cp_group`: its
    context-parallel group (step 1c)."""
    if torch.device(device).type == "meta":
        model = meta_model(cfg.model)  # model/transformer.py: shapes only, no initialisation to skip
    else:
        model = Transformer(cfg.model)
        if base_state is not None:
            model.load_state_dict(base_state)
    on_device = torch.device(device).type != "meta"
    if tp_comm is not None:
        apply_tensor_parallel(model, tp_comm, cfg.parallel.sequence_parallel)
    if cp_group is not None:
        apply_context_parallel(model, cp_group).shard_every_forward(model)
    # made where it trains already (the CPU), it is not moved: the roofline's trace builds it on fake
    # tensors (accounting/roofline/trace.py), which torch cannot move
    if on_device and stage is None and torch.device(device) != next(model.parameters()).device:
        model.to(device)
    prepare_model(model, policy, fp32_attention=cfg.train.fp32_attention,
                  fp8_scaling=cfg.train.fp8_scaling)
    if tp_comm is not None and policy.fp8:  # step 2's fp8 for the split linears (parallel/tp_fp8.py)
        apply_tensor_parallel_fp8(model, cfg.train.fp8_scaling)
    apply_recompute(model, cfg.train.recompute)
    apply_chunked_loss(model, cfg.train.loss_chunk_tokens)
    f = cfg.finetune
    if f.lora_rank is not None:
        lora = apply_tensor_parallel_lora if tp_comm is not None else apply_lora  # split adapters (tp_lora.py)
        lora(model, f.lora_targets, f.lora_rank, f.lora_alpha, f.lora_dropout)
        if f.adapter is not None and torch.device(device).type != "meta":  # continue a PEFT adapter
            load_peft_weights(model, f.adapter, cfg.model)
    if stage is not None:
        # after LoRA: the adapters are drawn as one process draws them (every layer's, in its
        # order); before the move: the device receives its stage alone
        cut_stage(model, *stage)
        if on_device:
            model.to(device)
    if cfg.train.compile and torch.device(device).type != "meta":  # nothing to run on the meta device
        apply_compile(model)
    return model


def build_optimizer(cfg: Config, policy: Policy, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of optim.name over the model's param groups for it (optim/build.py)."""
    return make_optimizer(cfg, policy, param_groups(cfg, model))


def build_engine(cfg: Config, policy: Policy, device: torch.device | str = "cpu",
                 base_state: dict[str, torch.Tensor] | None = None, timeline=None) -> Engine:
    """Steps 1-8: the model wrapped in the engine of train.parallel, with its optimizer, over the
    run's mesh (parallel/mesh.py: tp, cp, pipeline stages, data parallelism). Under a strategy
    other than none, torch.distributed must already be initialised (torchrun). With
    parallel.pp > 1 each rank builds its stage (the model cut after step 5) and the
    pipeline engine (`timeline` records its step: parallel/pipeline/timeline.py). `policy` is
    cfg.train.precision's; the launch was checked by parallel/world.py's `check_launch`."""
    groups = run_groups(cfg, device)
    optimizer = dict(make_optimizer=lambda groups: make_optimizer(cfg, policy, groups),
                     weight_decay_groups=lambda model: param_groups(cfg, model))
    if cfg.parallel.pp > 1:
        layout, layers = pipeline_place(cfg, torch.distributed.get_rank(), torch.distributed.get_world_size())
        model = build_model(cfg, policy, device, base_state, stage=(layers, layout.first, layout.last),
                            tp_comm=groups.tp_comm)
        return pipeline_engine(model, cfg, policy, layout, device=torch.device(device), groups=groups,
                               timeline=timeline, **optimizer)
    # with cp > 1 the ring over the cp group, and train.parallel over the dp x cp ranks (parallel/engine.py)
    model = build_model(cfg, policy, device, base_state, tp_comm=groups.tp_comm, cp_group=groups.cp_group)
    return parallelize(model, cfg, policy, groups=groups, **optimizer)


def build(cfg: Config, device: torch.device | str = "cpu",
          base_state: dict[str, torch.Tensor] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model and optimizer of a one-process run, built and wrapped in the documented order (the
    precision policy resolved here, once, from cfg.train.precision)."""
    policy = get_policy(cfg.train.precision)
    model = build_model(cfg, policy, device, base_state)
    return model, build_optimizer(cfg, policy, model)


def check_attention(model_cfg, device: torch.device) -> None:
    """What the first forward pass would refuse, refused before the run folder is written."""
    backend = model_cfg.attention
    if backend in FLASH_BACKENDS and model_cfg.dropout > 0:
        raise LmforgeError(f"model.attention={backend} does not support attention dropout "
                           f"(model.dropout={model_cfg.dropout}): set model.dropout=0 or use sdpa or naive")
    if backend == "flash_triton":
        reason = flash_triton.unavailable_reason(device)
        if reason:
            raise LmforgeError(reason)


def prepare_run_data(cfg: Config, world: World, resume: dict | None, log, warn, progress: bool) -> tuple:
    """(data, base weights, base identity): the data of any run (data/prepare.py's PreparedData, or
    train/finetune.py's FinetuneData), made by rank 0 first (once, under the data folder's lock), then opened
    by the others, who wait for it however long it takes (World.main_first); with the weights and
    identity of a fine-tuning run's base (None for a run from scratch, whose prepared data is
    checked against its model here).

    A run from scratch records where its data is: cfg.data.dir is set to the folder's absolute
    path, which the run's config.yaml keeps, so that a resume from any directory opens the same
    folder as it is (open_run_data); a resume whose folder is gone says so in one line and
    prepares it again, refused before writing if the corpus now trains another tokenizer than the
    one of `resume`, the checkpoint's state (None: a new run)."""
    if cfg.finetune.base is None:
        data_dir = data_dir_of(cfg)
        if resume and data_dir.is_dir():
            data = world.main_first(lambda: open_run_data(cfg), doing=f"open {data_dir}")
        else:
            if resume:
                where = "" if data_dir.is_absolute() else f" in {Path.cwd()}"
                log(f"note: the run's data folder {data_dir} is not there{where}: preparing it again from "
                    f"data.source={cfg.data.source} (pass data.dir=FOLDER if it lies elsewhere)")
            expected = resume["tokenizer_sha256"] if resume else None
            data = world.main_first(lambda: prepare_data(cfg, log=log, progress=progress, tokenizer_sha256=expected),
                                    doing=f"prepare {data_dir}")
        check_data(cfg, data, warn=warn)
        cfg.data.dir = os.path.abspath(data.dir)
        return data, None, None
    # rank 0 reads the base while the others wait: a local file read on each rank (runs/checkpoint/
    # read.py), never a collective that would wait for them
    from lmforge.train.finetune import prepare_finetune  # a fine-tuning run's code, read only by one

    return world.main_first(lambda: prepare_finetune(cfg, log=log),
                            doing=f"read the base {cfg.finetune.base} and the data {cfg.data.source}")


def check_data(cfg: Config, data, warn) -> None:
    """Prepared data that cannot train this model stops here (a smaller tokenizer only warns)."""
    tokenizer_vocab = data.meta["tokenizer_vocab_size"]
    if tokenizer_vocab > cfg.model.vocab_size:
        raise LmforgeError(f"the tokenizer in {data.dir} has {tokenizer_vocab} tokens but "
                           f"model.vocab_size is {cfg.model.vocab_size}: they must match")
    if tokenizer_vocab < cfg.model.vocab_size:
        # Allowed, since padding the vocabulary (e.g. to a multiple of 64) is a real speed trick;
        # but usually the corpus was too small for the BPE trainer to learn that many tokens.
        warn(f"the tokenizer in {data.dir} has {tokenizer_vocab} tokens, "
                           f"model.vocab_size is {cfg.model.vocab_size}: the other "
                           f"{cfg.model.vocab_size - tokenizer_vocab} embedding rows are never "
                           f"used (set model.vocab_size={tokenizer_vocab} unless that padding is on purpose)")
    check_windows(len(data.train), len(data.val), cfg.seq_len)  # a folder prepared for a shorter train.seq_len


def check_memory(plan: dict, cfg: Config) -> None:
    """A setup its plan says needs more memory than the whole device has stops before its first
    batch is drawn (train.batch_size=10**9 would otherwise grind for minutes, then be killed).
    The plan's bytes are tested against measured ones (tests/test_memory.py); only a setup beyond
    the device's total is refused, so a prediction near the limit never stops a run that fits."""
    memory = plan["memory"]
    needed, has = memory["per_device_bytes"], memory["device_memory_bytes"]
    if needed > has:
        raise LmforgeError(f"train.batch_size={cfg.train.batch_size}, train.seq_len={cfg.seq_len}: the plan needs "
                           f"{needed / 2**30:,.1f} GiB per device, {plan['time']['hardware']} has "
                           f"{has / 2**30:,.1f} GiB; lower the batch, the sequence or the model "
                           f"(lmforge plan shows the breakdown)")
