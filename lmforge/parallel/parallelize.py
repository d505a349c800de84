"""Data parallelism: one engine interface (engine.py) for every strategy of `train.parallel`.

    none   Engine                 one process (engine.py)
    ddp    DDPEngine              gradients all-reduced in buckets during backward (ddp.py)
    zero1  ZeroEngine(stage=1)    optimizer states (and fp32 master weights) sharded (zero.py)
    zero2  ZeroEngine(stage=2)    + gradients reduce-scattered and sharded
    zero3  ZeroEngine(stage=3)    + parameters sharded, gathered per block
    fsdp   FSDPEngine             PyTorch's fully_shard (fsdp.py)

each of them also over the dp x cp ranks of a context-parallel model (parallel.cp > 1: each cp
rank one more replica, cp_engine.py), and pipeline parallelism (train.pipeline_stages > 1):
PipelineEngine (pipeline/engine.py), each rank one stage; with more ranks than stages, each stage's replicas share its gradients and
optimizer through the engine of STAGE_REPLICA_ENGINES (pipeline/replicas.py): train.parallel=ddp
averages the gradients, zero1 shards the stage's optimizer states over its replicas (zero2, zero3
and fsdp do not combine with pipelines: pipeline/replicas.py says why, parallel/launch.py refuses).

`parallelize` is step 7 of train/setup.py: it takes the model as the steps before left it
(precision, recomputation, ...) and the process group that the launcher set up (torchrun;
parallel/world.py's `init_world`, whose `check_launch` (parallel/launch.py) has already refused what cannot run: the
engines do not check the launch again).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lmforge.common.errors import LmforgeError
from lmforge.modes.parallel import get_strategy
from lmforge.modes.precision import Policy
from lmforge.parallel.comm import Collectives
from lmforge.parallel.cp_engine import CONTEXT_PARALLEL_ENGINES
from lmforge.parallel.ddp import DDPEngine
from lmforge.parallel.engine import Engine
from lmforge.parallel.fsdp import FSDPEngine
from lmforge.parallel.pipeline.engine import PipelineEngine
from lmforge.parallel.pipeline.replicas import (StageReplicas, StageZero, TensorParallelStageReplicas,
                                                TensorParallelStageZero)
from lmforge.parallel.tp_engine import (TensorParallelDDPEngine, TensorParallelEngine, TensorParallelFSDPEngine,
                                        TensorParallelZeroEngine, whole_matrices_over_tp)
from lmforge.parallel.zero import ZeroEngine
from lmforge.precision.policy import torch_dtype


def working_dtype(policy: Policy) -> torch.dtype:
    """The dtype the sharding engines compute in: 16-bit under the autocast policies (the ZeRO
    paper's layout: 16-bit weights and gradients, fp32 master weights sharded with the moments),
    else the parameters' own."""
    return torch_dtype(policy.compute_dtype if policy.autocast else policy.param_dtype)


def require_process_group(setting: str) -> None:
    """For library callers that skipped `init_world`: the engines of `setting` need torch.distributed."""
    if not dist.is_initialized():
        raise LmforgeError(f"{setting} needs torch.distributed: launch with "
                           f"torchrun --nproc_per_node=N -m lmforge train ...")


# -- the data-parallel engines by strategy: builder(model, cfg, policy, make_optimizer, weight_decay_groups, comm,
#    groups): groups is the mesh's (hybrid sharding, parallel/mesh.py) or None (every rank one replica)

def _ddp(model, cfg, policy, make_optimizer, weight_decay_groups, comm, groups=None) -> Engine:
    return DDPEngine(model, make_optimizer(weight_decay_groups(model)), comm, cfg.train.bucket_mb)


def _zero(model, cfg, policy, make_optimizer, weight_decay_groups, comm, groups=None) -> Engine:
    return ZeroEngine(model, make_optimizer, weight_decay_groups(model), comm,
                      get_strategy(cfg.train.parallel).zero_stage, working_dtype(policy))


def _fsdp(model, cfg, policy, make_optimizer, weight_decay_groups, comm, groups=None) -> Engine:
    mesh = None if groups is None else groups.fsdp_mesh  # 2-D for hybrid sharding
    return FSDPEngine(model, make_optimizer, weight_decay_groups, comm, working_dtype(policy), mesh)


DATA_PARALLEL_ENGINES = {"ddp": _ddp, "zero1": _zero, "zero2": _zero, "zero3": _zero, "fsdp": _fsdp}


def parallelize(model: torch.nn.Module, cfg, policy: Policy, make_optimizer, weight_decay_groups,
                groups=None, tp_comm=None) -> Engine:
    """The engine of `cfg.train.parallel` around `model`. `make_optimizer(param_groups)` builds
    AdamW as the config says; `weight_decay_groups(model)` gives the model's param groups (which
    parameters decay): the engines that shard turn them into groups of their shards. A
    tensor-parallel model (parallel.tp > 1) comes with its mesh's `groups` and its tp group's
    `tp_comm`: its replicas are data-parallel over the dp group (tp_engine.py). A context-parallel
    one (groups.cp > 1) is data-parallel over the dp x cp group (cp_engine.py)."""
    strategy = get_strategy(cfg.train.parallel).name
    if groups is not None and groups.cp > 1:
        return _context_parallel(model, cfg, policy, strategy, make_optimizer, weight_decay_groups, groups, tp_comm)
    if tp_comm is not None:
        return _tensor_parallel(model, cfg, policy, strategy, make_optimizer, weight_decay_groups, groups, tp_comm)
    if strategy == "none":
        return Engine(model, make_optimizer(weight_decay_groups(model)))
    require_process_group(f"train.parallel={strategy}")
    comm = Collectives()
    engine = DATA_PARALLEL_ENGINES[strategy](model, cfg, policy, make_optimizer, weight_decay_groups, comm, groups)
    comm.reset()  # setup's broadcasts are not a step's traffic
    return engine


def _tensor_parallel(model, cfg, policy, strategy: str, make_optimizer, weight_decay_groups, groups, tp_comm) -> Engine:
    """Strategy none (one replica), or ddp, zero1-3 or fsdp over the dp group, as parallel/launch.py allowed."""
    if strategy in ("none", "ddp"):  # whole tp slices in the optimizer: Muon gathers its matrices over tp
        optimizer = make_optimizer(weight_decay_groups(model))
        whole_matrices_over_tp(optimizer, tp_comm)
    if strategy == "none":
        return TensorParallelEngine(model, optimizer, tp_comm)
    comm = Collectives(groups.dp_group)
    if strategy == "ddp":
        engine = TensorParallelDDPEngine(model, optimizer, comm, cfg.train.bucket_mb, tp_comm)
    elif strategy == "fsdp":
        engine = TensorParallelFSDPEngine(model, make_optimizer, weight_decay_groups, comm, working_dtype(policy),
                                          groups.fsdp_mesh, tp_comm)
    else:
        engine = TensorParallelZeroEngine(model, make_optimizer, weight_decay_groups(model), comm,
                                          get_strategy(strategy).zero_stage, working_dtype(policy), tp_comm)
    comm.reset()  # setup's broadcasts are not a step's traffic
    return engine


def _context_parallel(model, cfg, policy, strategy: str, make_optimizer, weight_decay_groups, groups,
                      tp_comm) -> Engine:
    """ddp, zero1-3 or fsdp over the dp x cp group (each cp rank one more replica: cp_engine.py),
    tensor-parallel inside with `tp_comm`; parallel/launch.py refused strategy none."""
    comm = Collectives(groups.dp_cp_group)
    plain, tensor_parallel = CONTEXT_PARALLEL_ENGINES[strategy]
    engine_class, tp = (plain, ()) if tp_comm is None else (tensor_parallel, (tp_comm,))
    if strategy == "ddp":
        args = (make_optimizer(weight_decay_groups(model)), comm, cfg.train.bucket_mb)
    elif strategy == "fsdp":  # fully_shard over the same ranks: a 1-D mesh of the dp x cp group
        mesh = DeviceMesh.from_group(groups.dp_cp_group, groups.mesh.device_type)
        args = (make_optimizer, weight_decay_groups, comm, working_dtype(policy), mesh)
    else:
        args = (make_optimizer, weight_decay_groups(model), comm, get_strategy(strategy).zero_stage,
                working_dtype(policy))
    engine = engine_class(groups, model, *args, *tp)
    comm.reset()  # setup's broadcasts are not a step's traffic
    return engine


# -- the pipeline engines by train.pipeline_engine ----------------------------------------------------

def _torch_pipeline_engine(*args, **kwargs) -> Engine:
    # imported on use: torch.distributed.pipelining takes a second to load, and only this option needs it
    from lmforge.parallel.pipeline.torch_engine import TorchPipelineEngine
    return TorchPipelineEngine(*args, **kwargs)


PIPELINE_STAGE_ENGINES = {"lmforge": PipelineEngine, "torch": _torch_pipeline_engine}


# -- how a stage's replicas share its work, by strategy: builder(model, cfg, policy, make_optimizer, weight_decay_groups, comm)

def _stage_replicas(model, cfg, policy, make_optimizer, weight_decay_groups, comm, tp_comm=None) -> Engine:
    if tp_comm is not None:
        return TensorParallelStageReplicas(model, make_optimizer(weight_decay_groups(model)), comm, tp_comm)
    return StageReplicas(model, make_optimizer(weight_decay_groups(model)), comm)


def _stage_zero(model, cfg, policy, make_optimizer, weight_decay_groups, comm, tp_comm=None) -> Engine:
    if tp_comm is not None:
        return TensorParallelStageZero(model, make_optimizer, weight_decay_groups(model), comm, working_dtype(policy),
                                       tp_comm)
    return StageZero(model, make_optimizer, weight_decay_groups(model), comm, working_dtype(policy))


STAGE_REPLICA_ENGINES = {"none": _stage_replicas, "ddp": _stage_replicas, "zero1": _stage_zero}


def pipeline_engine(model, cfg, policy: Policy, layout, make_optimizer, weight_decay_groups, device: torch.device,
                    groups, timeline=None, tp_comm=None) -> Engine:
    """The engine of a pipeline stage (`model` already cut and wrapped); `make_optimizer` and
    `weight_decay_groups` as `parallelize` takes them, for the engine of the stage's replicas;
    `groups` the (pp, dp, tp) mesh's (parallel/mesh.py), `tp_comm` its tp group's with parallel.tp > 1."""
    t = cfg.train
    strategy = get_strategy(t.parallel).name
    replicas = STAGE_REPLICA_ENGINES[strategy]
    # the residual stream's: ZeRO computes on its working dtype (16-bit under the mixed policies)
    hidden_dtype = working_dtype(policy) if strategy == "zero1" else torch_dtype(policy.param_dtype)

    def replicas_engine(comm) -> Engine:  # over the stage's data group, which the pipeline engine creates
        return replicas(model, cfg, policy, make_optimizer, weight_decay_groups, comm, tp_comm)

    # what crosses a stage boundary: the residual stream, split along the sequence under sequence parallelism
    tokens = cfg.seq_len // cfg.parallel.tp if cfg.parallel.sequence_parallel else cfg.seq_len
    engine = PIPELINE_STAGE_ENGINES[t.pipeline_engine](
        model, replicas_engine, layout, t.schedule, t.micro_batches, (t.batch_size, tokens, cfg.model.d_model),
        hidden_dtype, device, tied=cfg.model.tie_embeddings, groups=groups, timeline=timeline, tp_comm=tp_comm)
    engine.comm.reset()  # setup's broadcasts are not a step's traffic
    return engine
