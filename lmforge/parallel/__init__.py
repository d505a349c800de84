"""Data parallelism: one engine interface (engine.py) for every strategy of `train.parallel`.

    none   Engine                 one process (engine.py)
    ddp    DDPEngine              gradients all-reduced in buckets during backward (ddp.py)
    zero1  ZeroEngine(stage=1)    optimizer states (and fp32 master weights) sharded (zero.py)
    zero2  ZeroEngine(stage=2)    + gradients reduce-scattered and sharded
    zero3  ZeroEngine(stage=3)    + parameters sharded, gathered per block
    fsdp   FSDPEngine             PyTorch's fully_shard (fsdp.py)

`parallelize` is step 4 of train/setup.py: it takes the model as steps 1-3 left it (precision,
recomputation) and the process group that the launcher set up (torchrun; train/ owns that).
"""

import torch
import torch.distributed as dist

from lmforge.errors import LmforgeError
from lmforge.parallel.comm import Collectives
from lmforge.parallel.engine import Engine
from lmforge.parallel_modes import get_strategy
from lmforge.precision import get_policy
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
    if strategy.name == "none":
        return
    if world_size < 2:
        raise LmforgeError(f"train.parallel={strategy.name} needs at least 2 processes: launch with "
                           f"torchrun --nproc_per_node=N -m lmforge train ... (or use train.parallel=none)")


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
