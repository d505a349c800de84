"""Data parallelism: one engine interface (engine.py) for every strategy of `train.parallel`.

    none   Engine                 one process (engine.py)
    ddp    DDPEngine              gradients all-reduced in buckets during backward (ddp.py)
    zero1  ZeroEngine(stage=1)    optimizer states (and fp32 master weights) sharded (zero.py)
    zero2  ZeroEngine(stage=2)    + gradients reduce-scattered and sharded
    zero3  ZeroEngine(stage=3)    + parameters sharded, gathered per block
    fsdp   FSDPEngine             PyTorch's fully_shard (fsdp.py)

and pipeline parallelism (train.pipeline_stages > 1): PipelineEngine (pipeline.py), each rank one
stage, its replicas (more ranks than stages, train.parallel=ddp) averaging their gradients.

`parallelize` is step 4 of train/setup.py: it takes the model as steps 1-3 left it (precision,
recomputation) and the process group that the launcher set up (torchrun; train/ owns that).
"""

import torch
import torch.distributed as dist

from lmforge.common.errors import LmforgeError
from lmforge.parallel.comm import Collectives
from lmforge.parallel.engine import Engine
from lmforge.modes.parallel import get_strategy
from lmforge.modes.precision import get_policy
from lmforge.precision.policy import torch_dtype


def working_dtype(precision: str) -> torch.dtype:
    """The dtype the sharding engines compute in: 16-bit under the autocast policies (the ZeRO
    paper's layout: 16-bit weights and gradients, fp32 master weights sharded with the moments),
    else the parameters' own."""
    policy = get_policy(precision)
    return torch_dtype(policy.compute_dtype if policy.autocast else policy.param_dtype)


def check_parallel(cfg, world_size: int) -> None:
    """What the chosen strategy cannot do, refused with one line before anything is built."""
    strategy = get_strategy(cfg.train.parallel)
    if cfg.train.pipeline_stages > 1:
        check_pipeline(cfg, world_size)
        return
    if strategy.name == "none":
        return
    if world_size < 2:
        raise LmforgeError(f"train.parallel={strategy.name} needs at least 2 processes: launch with "
                           f"torchrun --nproc_per_node=N -m lmforge train ... (or use train.parallel=none)")


def check_pipeline(cfg, world_size: int) -> None:
    t = cfg.train
    p, parallel = t.pipeline_stages, get_strategy(t.parallel).name
    launch = f"launch with torchrun --nproc_per_node={p} -m lmforge train ... (or lmforge train --nproc {p} ...)"
    if world_size < p or world_size % p:
        raise LmforgeError(f"train.pipeline_stages={p} needs one process per stage (or a multiple of {p}: replicas), "
                           f"not {world_size}: {launch}")
    replicas = world_size // p
    if replicas > 1 and parallel != "ddp":
        raise LmforgeError(f"{world_size} ranks = {p} stages x {replicas} replicas: the replicas average their "
                           f"gradients as DDP does; set train.parallel=ddp (ZeRO and FSDP do not combine with "
                           f"pipelines here)")
    if parallel not in ("none", "ddp"):
        raise LmforgeError(f"train.parallel={parallel} does not combine with train.pipeline_stages={p}: use "
                           f"train.parallel=none (or ddp with replicas)")
    if cfg.finetune.lora_rank is not None:
        raise LmforgeError("LoRA fine-tuning does not run on a pipeline: set train.pipeline_stages=1 "
                           "(adapters are small: data parallelism fits them)")
    if t.precision == "fp16-mixed" and t.pipeline_engine == "torch":
        raise LmforgeError("train.pipeline_engine=torch does not scale the loss (fp16-mixed): use "
                           "train.pipeline_engine=lmforge or bf16-mixed")


def pipeline_place(cfg, rank: int, world_size: int):
    """(this rank's PipelineLayout, the layers its stage holds)."""
    from lmforge.accounting.pipeline import pipeline_split, stage_layers
    from lmforge.parallel.pipeline.engine import PipelineLayout

    layout = PipelineLayout.of(rank, world_size, cfg.train.pipeline_stages)
    split = pipeline_split(cfg.model, layout.stages, cfg.train.pipeline_split, cfg.seq_len)
    return layout, stage_layers(split)[layout.stage]


def pipeline_engine(model, cfg, layout, optimizer, device: torch.device, timeline=None) -> Engine:
    """The engine of a pipeline stage (`model` already cut and wrapped)."""
    from lmforge.parallel.pipeline.engine import PipelineEngine

    hidden_dtype = torch_dtype(get_policy(cfg.train.precision).param_dtype)  # the residual stream's
    engine_class = PipelineEngine
    if cfg.train.pipeline_engine == "torch":
        from lmforge.parallel.pipeline.torch_engine import TorchPipelineEngine
        engine_class = TorchPipelineEngine
    return engine_class(model, optimizer, layout, cfg.train.schedule, cfg.train.micro_batches,
                        (cfg.train.batch_size, cfg.seq_len, cfg.model.d_model), hidden_dtype, device,
                        tied=cfg.model.tie_embeddings, timeline=timeline)


def parallelize(model: torch.nn.Module, cfg, make_optimizer, weight_decay_groups) -> Engine:
    """The engine of `cfg.train.parallel` around `model`. `make_optimizer(param_groups)` builds
    AdamW as the config says; `weight_decay_groups(model)` gives the model's param groups (which
    parameters decay): the engines that shard turn them into groups of their shards."""
    strategy = get_strategy(cfg.train.parallel)
    if strategy.name == "none":
        return Engine(model, make_optimizer(weight_decay_groups(model)))
    if not dist.is_initialized():
        raise LmforgeError(f"train.parallel={strategy.name} needs torch.distributed: launch with "
                           f"torchrun --nproc_per_node=N -m lmforge train ...")
    check_parallel(cfg, dist.get_world_size())
    comm = Collectives()
    if strategy.name == "ddp":
        from lmforge.parallel.ddp import DDPEngine
        engine = DDPEngine(model, make_optimizer(weight_decay_groups(model)), comm, cfg.train.bucket_mb)
    elif strategy.name == "fsdp":
        from lmforge.parallel.fsdp import FSDPEngine
        engine = FSDPEngine(model, make_optimizer, weight_decay_groups, comm, working_dtype(cfg.train.precision))
    else:
        from lmforge.parallel.zero import ZeroEngine
        engine = ZeroEngine(model, make_optimizer, weight_decay_groups(model), comm, strategy.zero_stage,
                            working_dtype(cfg.train.precision))
    comm.reset()  # setup's broadcasts are not a step's traffic
    return engine
