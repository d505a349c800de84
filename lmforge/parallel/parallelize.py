"""Data parallelism: one engine interface (engine.py), one engine per strategy of `train.parallel`.

    none   Engine                 one replica (engine.py)
    ddp    DDPEngine              gradients all-reduced in buckets during backward (ddp.py)
    zero1  ZeroEngine(stage=1)    optimizer states (and fp32 master weights) sharded (zero.py)
    zero2  ZeroEngine(stage=2)    + gradients reduce-scattered and sharded
    zero3  ZeroEngine(stage=3)    + parameters sharded, gathered per block
    fsdp   FSDPEngine             PyTorch's fully_shard (fsdp.py)

Each is handed the run's mesh groups (parallel/mesh.py's `ParallelGroups`, as torchtitan's
ParallelDims hands its sub-meshes to one parallelize function) and does what the other
dimensions change through them: over the dp ranks, or the dp x cp ranks of a context-parallel
model (each cp rank one more replica of its shard; torchtitan's "dp_cp"), with a tensor-parallel
model's tp group for the norm and the whole tensors by name (tp_engine.py). No class per
combination: one path, `parallelize`.

Pipeline parallelism (parallel.pp > 1): PipelineEngine (pipeline/engine.py), each rank
one stage, around the engine of the stage's replicas (the mesh's dp group), from
STAGE_REPLICA_ENGINES: ddp (or none: one replica) DDPEngine without buckets, each gradient
all-reduced once after the schedule; zero1 ZeroEngine(stage=1), the stage's optimizer states
sharded over its replicas.

Why not ZeRO-2, ZeRO-3 or FSDP on a stage's replicas (config/rules.py refuses them before
launch): a pipeline step runs a backward per micro-batch, so each parameter's gradient is
produced m times. ZeRO-2 saves its memory by reduce-scattering a gradient as soon as backward
produces it and dropping it; here it would either reduce-scatter m times per step (m x ZeRO-1's
traffic) or keep the full gradient until the last micro-batch, which is ZeRO-1's memory. ZeRO-3
and FSDP gather each block's parameters before its forward and again before its backward: 2m
gathers per step instead of 2, or, kept gathered through the step, ZeRO-1's memory again.
DeepSpeed refuses ZeRO-2/3 with its pipeline engine for the same reason.

`parallelize` is step 7 of train/setup.py: it takes the model as the steps before left it
(precision, recomputation, ...) and the mesh that setup built over the process group the launcher
set up (torchrun; parallel/world.py's `init_world`, whose `check_launch` has
already refused what cannot run: the engines do not check the launch again).
"""

import torch
import torch.distributed as dist

from lmforge.common.errors import LmforgeError
from lmforge.modes import PARALLEL_STRATEGIES, Policy, get_strategy
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.engine import Engine
from lmforge.parallel.fsdp import FSDPEngine
from lmforge.parallel.mesh import ONE_PROCESS, ParallelGroups, build_groups, hybrid_replicate
from lmforge.parallel.pipeline.engine import PipelineEngine
from lmforge.parallel.zero import ZeroEngine
from lmforge.precision.policy import torch_dtype


def working_dtype(policy: Policy) -> torch.dtype:
    """The dtype the sharding engines compute in: 16-bit under the autocast policies (the ZeRO
    paper's layout: 16-bit weights and gradients, fp32 master weights sharded with the moments),
    else the parameters' own."""
    return torch_dtype(policy.compute_dtype if policy.autocast else policy.param_dtype)


def run_groups(cfg, device: torch.device | str = "cpu") -> ParallelGroups:
    """The mesh of `cfg`'s run (parallel.tp, parallel.cp, the pipeline's stages, hybrid sharding),
    or ONE_PROCESS where nothing is distributed (strategy none, every degree 1)."""
    p, pp = cfg.parallel, cfg.parallel.pp
    if cfg.train.parallel == "none" and p.tp == p.cp == pp == 1:
        return ONE_PROCESS
    if not dist.is_initialized():  # library callers that skipped `init_world`
        setting = (f"parallel.pp={pp}" if pp > 1 else f"parallel.tp={p.tp} parallel.cp={p.cp}"
                   if p.tp > 1 or p.cp > 1 else f"train.parallel={cfg.train.parallel}")
        raise LmforgeError(f"{setting} needs torch.distributed: launch with "
                           f"torchrun --nproc_per_node=N -m lmforge train ...")
    return build_groups(p.tp, device, p.cp, pp, hybrid_replicate(cfg))


# -- the engine of each strategy: builder(model, cfg, policy, make_optimizer, weight_decay_groups, groups) ---------

def _none(model, cfg, policy, make_optimizer, weight_decay_groups, groups) -> Engine:
    return Engine(model, make_optimizer(weight_decay_groups(model)), groups)


def _ddp(model, cfg, policy, make_optimizer, weight_decay_groups, groups) -> Engine:
    return DDPEngine(model, make_optimizer(weight_decay_groups(model)), groups, cfg.train.bucket_mb)


def _zero(model, cfg, policy, make_optimizer, weight_decay_groups, groups) -> Engine:
    return ZeroEngine(model, make_optimizer, weight_decay_groups(model), groups,
                      get_strategy(cfg.train.parallel).zero_stage, working_dtype(policy))


def _fsdp(model, cfg, policy, make_optimizer, weight_decay_groups, groups) -> Engine:
    return FSDPEngine(model, make_optimizer, weight_decay_groups, groups, working_dtype(policy))


DATA_PARALLEL_ENGINES = {"none": _none, "ddp": _ddp, "zero1": _zero, "zero2": _zero, "zero3": _zero, "fsdp": _fsdp}
assert set(DATA_PARALLEL_ENGINES) == set(PARALLEL_STRATEGIES)


def parallelize(model: torch.nn.Module, cfg, policy: Policy, make_optimizer, weight_decay_groups,
                groups: ParallelGroups | None = None) -> Engine:
    """The engine of `cfg.train.parallel` around `model`, over the mesh's `groups` (None: the mesh
    of `cfg`, `run_groups`). `make_optimizer(param_groups)` builds the optimizer
    as the config says; `weight_decay_groups(model)` gives the model's param groups (which
    parameters decay): the engines that shard turn them into groups of their shards."""
    if groups is None:
        groups = run_groups(cfg, next(model.parameters()).device)
    engine = DATA_PARALLEL_ENGINES[get_strategy(cfg.train.parallel).name](
        model, cfg, policy, make_optimizer, weight_decay_groups, groups)
    if engine.comm is not None:
        engine.comm.reset()  # setup's broadcasts are not a step's traffic
    return engine


# -- the pipeline engines by train.pipeline_engine ----------------------------------------------------

def _torch_pipeline_engine(*args, **kwargs) -> Engine:
    # imported on use: torch.distributed.pipelining takes a second to load, and only this option needs it
    from lmforge.parallel.pipeline.torch_engine import TorchPipelineEngine
    return TorchPipelineEngine(*args, **kwargs)


PIPELINE_STAGE_ENGINES = {"lmforge": PipelineEngine, "torch": _torch_pipeline_engine}


def _stage_replicas(model, cfg, policy, make_optimizer, weight_decay_groups, groups) -> Engine:
    """ddp, or none (one replica), on a pipeline stage: DDP without buckets (ddp.py)."""
    return DDPEngine(model, make_optimizer(weight_decay_groups(model)), groups, bucket_mb=None)


# how a stage's replicas share its work, by strategy (the others: config/rules.py's PIPELINE_REFUSED)
STAGE_REPLICA_ENGINES = {"none": _stage_replicas, "ddp": _stage_replicas, "zero1": _zero}


def pipeline_engine(model, cfg, policy: Policy, layout, make_optimizer, weight_decay_groups, device: torch.device,
                    groups: ParallelGroups, timeline=None) -> Engine:
    """The engine of a pipeline stage (`model` already cut and wrapped) around the engine of the
    stage's replicas; `make_optimizer` and `weight_decay_groups` as `parallelize` takes them;
    `groups` the (pp, dp, tp) mesh's (parallel/mesh.py)."""
    t = cfg.train
    strategy = get_strategy(t.parallel).name
    # the residual stream's: ZeRO computes on its working dtype (16-bit under the mixed policies)
    hidden_dtype = working_dtype(policy) if strategy == "zero1" else torch_dtype(policy.param_dtype)
    stage_engine = STAGE_REPLICA_ENGINES[strategy](model, cfg, policy, make_optimizer, weight_decay_groups, groups)
    # what crosses a stage boundary: the residual stream, split along the sequence under sequence parallelism
    tokens = cfg.seq_len // cfg.parallel.tp if cfg.parallel.sequence_parallel else cfg.seq_len
    engine = PIPELINE_STAGE_ENGINES[t.pipeline_engine](
        model, stage_engine, layout, t.schedule, t.micro_batches, (t.batch_size, tokens, cfg.model.d_model),
        hidden_dtype, device, tied=cfg.model.tie_embeddings, groups=groups, timeline=timeline)
    engine.comm.reset()  # setup's broadcasts are not a step's traffic
    return engine
