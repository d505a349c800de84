"""The one launch check: whether the config can run on the processes torchrun started (strategy
against world size, pipeline stages and replicas, the device each rank takes), refused in one line
before any process group exists (parallel/world.py's `init_world` calls `check_launch` once), and
the device a name stands for."""

import torch

from lmforge.common.errors import LmforgeError
from lmforge.config.degrees import mesh_degrees
from lmforge.modes.parallel import get_strategy


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """The torch device for `name` (auto, cpu, cuda, cuda:N), checked; `setting` names the option
    that gave it, for the message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LmforgeError(f"{setting}={name} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LmforgeError(f"{setting}={name}: lmforge runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmforgeError(f"{setting}={name} but no CUDA device is available: use cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LmforgeError(f"{setting}={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def check_launch(cfg, env: tuple[int, int, int] | None, cuda_devices: int) -> torch.device:
    """The device this rank trains on, once the launch fits the config (strategy, pipeline
    stages and replicas, device); LmforgeError otherwise. The one check of a launch: `init_world`
    runs it before any process group exists, and what it accepts the engines can build."""
    parallel = get_strategy(cfg.train.parallel).name
    stages = cfg.train.pipeline_stages
    _check_optimizer(cfg, parallel)
    if env is not None and (cfg.parallel.dp_replicate or cfg.parallel.dp_shard):
        mesh_degrees(cfg, env[1])  # the product of the degrees given against the world
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        raise LmforgeError("parallel.sequence_parallel=true splits the tokens over the tensor-parallel ranks: "
                           "set parallel.tp > 1")
    if cfg.parallel.cp > 1:
        _check_context_parallel(cfg, env)
        return _rank_device(cfg.train.device, env[2], cuda_devices)
    if cfg.parallel.tp > 1:
        _check_tensor_parallel(cfg, env)
        if stages > 1:  # pipelines of tensor-parallel stages
            _check_pipeline(cfg, env[1])
        return _rank_device(cfg.train.device, env[2], cuda_devices)
    if env is None:
        if stages > 1:
            raise LmforgeError(f"train.pipeline_stages={stages} needs one process per stage: launch with "
                               f"torchrun --nproc_per_node={stages} -m lmforge train ... or lmforge train "
                               f"--nproc {stages} ...")
        if parallel != "none":
            raise LmforgeError(f"train.parallel={parallel} needs one process per device: launch with "
                               f"torchrun --nproc_per_node=N -m lmforge train ... or lmforge train --nproc N ... "
                               f"(or set train.parallel=none for one process)")
        return resolve_device(cfg.train.device)
    rank, world_size, local_rank = env
    if stages > 1:
        _check_pipeline(cfg, world_size)
    elif parallel == "none" and world_size > 1:
        # Refused rather than guessed: the strategies differ in memory and speed, and N ranks
        # training alone would write one folder N times.
        raise LmforgeError(f"train.parallel=none under torchrun with {world_size} processes: choose how they share "
                           f"the work, e.g. train.parallel=ddp (or zero1, zero2, zero3, fsdp)")
    return _rank_device(cfg.train.device, local_rank, cuda_devices)


def _check_optimizer(cfg, parallel: str) -> None:
    """An optimizer that needs whole matrices where the strategy shards them in a way it cannot use
    (docs/optimizers.md's "where each runs" says what is tested where)."""
    name, tp = cfg.optim.name, cfg.parallel.tp
    if name == "adafactor" and tp > 1:
        raise LmforgeError(f"optim.name=adafactor does not combine with parallel.tp={tp}: its factored second moment "
                           f"needs each whole matrix's row and column sums and each tensor rank holds a slice; use "
                           f"another optimizer (adamw, muon, lion, ...) or parallel.tp=1")
    # Muon gathers each split matrix over the tp group (parallel/tp_engine.py's TensorParallelMatrices)
    # where the optimizer holds whole tp slices: strategy none or ddp, one stage, no cp
    if name == "muon" and tp > 1 and (parallel not in ("none", "ddp") or cfg.parallel.cp > 1
                                      or cfg.train.pipeline_stages > 1):
        where = (f"train.parallel={parallel}" if parallel not in ("none", "ddp") else
                 f"parallel.cp={cfg.parallel.cp}" if cfg.parallel.cp > 1 else
                 f"train.pipeline_stages={cfg.train.pipeline_stages}")
        raise LmforgeError(f"optim.name=muon does not combine with parallel.tp={tp} and {where}: Newton-Schulz "
                           f"gathers each matrix over the tensor ranks only under train.parallel=none or ddp, "
                           f"without cp or pipeline stages; use one of those or parallel.tp=1")
    if name == "adafactor" and parallel in ("zero1", "zero2", "zero3", "fsdp"):
        raise LmforgeError(f"optim.name=adafactor does not combine with train.parallel={parallel}: its second "
                           f"moment is factored by each matrix's rows and columns, which {parallel}'s flat shards "
                           f"do not keep; use train.parallel=ddp")
    if name == "muon" and parallel == "fsdp":
        raise LmforgeError("optim.name=muon does not combine with train.parallel=fsdp: Newton-Schulz needs whole "
                           "matrices, gathered from ZeRO's flat shards but not from FSDP's; use train.parallel="
                           "zero1, zero2, zero3 or ddp")


# why each strategy a pipeline cannot take is refused (parallel/pipeline/replicas.py says more): a
# pipeline step runs one backward per micro-batch
PIPELINE_REFUSED = {  # why: a pipeline step runs one backward per micro-batch (m of them)
    "zero2": "ZeRO-2 would reduce-scatter each gradient m times a step, or keep it whole (ZeRO-1's memory)",
    "zero3": "ZeRO-3 would gather each block 2m times a step, not 2, or keep it gathered",
    "fsdp": "FSDP would gather each block 2m times a step, not 2 (as ZeRO-3)",
}


def _check_pipeline(cfg, world_size: int) -> None:
    """What a pipeline of train.pipeline_stages stages on `world_size` ranks cannot do."""
    t = cfg.train
    p, parallel, tp = t.pipeline_stages, get_strategy(t.parallel).name, cfg.parallel.tp
    launch = f"launch with torchrun --nproc_per_node={p * tp} -m lmforge train ... (or lmforge train --nproc {p * tp} ...)"
    if world_size < p * tp or world_size % (p * tp):
        per_stage = "one process per stage" if tp == 1 else f"parallel.tp={tp} processes per stage"
        raise LmforgeError(f"train.pipeline_stages={p} needs {per_stage} (or a multiple of {p * tp}: replicas), "
                           f"not {world_size}: {launch}")
    replicas = world_size // (p * tp)
    if parallel in PIPELINE_REFUSED:
        raise LmforgeError(f"train.parallel={parallel} does not combine with train.pipeline_stages={p}: "
                           f"{PIPELINE_REFUSED[parallel]}; use train.parallel=zero1 (shards each stage's optimizer "
                           f"states) or ddp")
    if replicas > 1 and parallel == "none":
        raise LmforgeError(f"{world_size} ranks = {p} stages x {replicas} replicas: choose how each stage's "
                           f"replicas share its gradients: train.parallel=ddp or zero1")
    if t.precision == "fp16-mixed" and t.pipeline_engine == "torch":
        raise LmforgeError("train.pipeline_engine=torch does not scale the loss (fp16-mixed): use "
                           "train.pipeline_engine=lmforge or bf16-mixed")
    if tp > 1:
        for setting, (refused, why) in PP_TP_REFUSED.items():
            if refused(cfg):
                raise LmforgeError(f"train.pipeline_stages={p} with parallel.tp={tp} does not combine with "
                                   f"{setting}: {why}")


# what pipelines of tensor-parallel stages (parallel/pipeline/engine.py) are not combined with yet, and why
PP_TP_REFUSED = {
    "parallel.sequence_parallel": (lambda c: c.parallel.sequence_parallel and c.train.pipeline_engine == "torch",
                                   "train.pipeline_engine=torch's stages with sequence shards are untested: use "
                                   "train.pipeline_engine=lmforge or parallel.sequence_parallel=false"),
}


# what tensor parallelism (parallel/tp.py) is not combined with yet, and why: setting -> (refused when, why)
TP_REFUSED = {
    "train.precision": (lambda c: c.train.precision == "fp8" and c.parallel.sequence_parallel,
                        "fp8's split linears would keep the gathered input for backward, not this rank's "
                        "sequence shard (parallel/tp_fp8.py): set parallel.sequence_parallel=false"),
    "train.loss_chunk_tokens": (lambda c: c.train.loss_chunk_tokens > 0,
                                "the vocabulary-parallel loss already never holds the whole logits"),
    "train.sample_tokens": (lambda c: c.train.sample_tokens > 0 and c.parallel.sequence_parallel,
                            "a decoding step's one new token cannot be split along the sequence: set "
                            "train.sample_tokens=0, or parallel.sequence_parallel=false"),
}


TP_DATA_PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")  # over the dp group (parallel/tp_engine.py)


def tp_divisibility(model_cfg, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model's heads, vocabulary and MLP evenly (None: they can);
    fewer KV heads than ranks are replicated (parallel/tp.py) when tp is a multiple of them."""
    kv = model_cfg.kv_heads
    if kv % tp and tp % kv:
        return (f"parallel.tp={tp} must divide the KV heads (model.n_kv_heads) = {kv} or be a multiple of them "
                f"(each KV head then on tp / n_kv_heads ranks)")
    for what, count in (("model.n_heads", model_cfg.n_heads), ("model.vocab_size", model_cfg.vocab_size),
                        ("the MLP width (model.d_ff)", model_cfg.ffn_dim)):
        if count % tp:
            return f"parallel.tp={tp} must divide {what} = {count}"
    return None


def _check_tensor_parallel(cfg, env) -> None:
    """parallel.tp > 1: world = (world / tp) replicas x tp ranks (parallel/mesh.py; with pipeline stages,
    stages x replicas x tp), the replicas
    under train.parallel=ddp, zero1-3 or fsdp (or none with one replica), and a model the ranks can split."""
    tp, parallel = cfg.parallel.tp, get_strategy(cfg.train.parallel).name
    if env is None:
        raise LmforgeError(f"parallel.tp={tp} needs {tp} processes per model replica: launch with torchrun "
                           f"--nproc_per_node={tp} -m lmforge train ... or lmforge train --nproc {tp} ...")
    world_size, stages = env[1], cfg.train.pipeline_stages
    if world_size % (tp * stages):
        raise LmforgeError(f"parallel.tp={tp} on {world_size} processes: the world must be (replicas x tp), "
                           f"a multiple of {tp}" if stages == 1 else
                           f"train.pipeline_stages={stages} x parallel.tp={tp} on {world_size} processes: the "
                           f"world must be (stages x replicas x tp), a multiple of {stages * tp}")
    dp = world_size // (tp * stages)
    if parallel not in TP_DATA_PARALLEL or (dp > 1 and parallel == "none"):
        raise LmforgeError(f"{world_size} processes = {dp} replicas x parallel.tp={tp}: the replicas share their "
                           f"gradients by train.parallel=ddp, zero1, zero2, zero3 or fsdp (or none with one replica), "
                           f"not {parallel}")
    for setting, (refused, why) in TP_REFUSED.items():
        if refused(cfg):
            raise LmforgeError(f"parallel.tp={tp} does not combine with {setting}: {why}")
    reason = tp_divisibility(cfg.model, tp)
    if reason:
        raise LmforgeError(reason)
    if cfg.parallel.sequence_parallel:
        if cfg.model.family == "gpt":
            raise LmforgeError("parallel.sequence_parallel=true with model.family=gpt: its learned positions are "
                               "added to the whole sequence (not written); use the llama family")
        if cfg.seq_len % tp and cfg.parallel.cp == 1:  # with cp, each cp shard is padded to a multiple of tp
            raise LmforgeError(f"parallel.sequence_parallel=true splits train.seq_len={cfg.seq_len} over "
                               f"parallel.tp={tp} ranks: use a multiple of {tp}")


# what context parallelism (parallel/cp_model.py) is not combined with yet, and why: setting -> (refused when, why)
CP_REFUSED = {
    "train.pipeline_stages": (lambda c: c.train.pipeline_stages > 1, "pipelines of context-parallel stages are not wired"),
    "model.dropout": (lambda c: c.model.dropout > 0, "ring attention has no dropout, and per-rank masks would not "
                                                     "match one process's: set model.dropout=0"),
    "model.sliding_window": (lambda c: c.model.sliding_window is not None, "the ring's masks are the causal ones"),
    "train.loss_chunk_tokens": (lambda c: c.train.loss_chunk_tokens > 0,
                                "the chunked loss would replace the group's loss (each rank already holds 1/cp of the logits)"),
    "train.sample_tokens": (lambda c: c.train.sample_tokens > 0,
                            "generation needs a KV cache, which the ring does not keep: set train.sample_tokens=0"),
}


def _check_context_parallel(cfg, env) -> None:
    """parallel.cp > 1: world = dp replicas x cp ranks (parallel/mesh.py), gradients reduced over
    them by train.parallel (ddp, zero1-3, fsdp: parallel/cp_engine.py), sequences long enough to shard."""
    cp, parallel = cfg.parallel.cp, get_strategy(cfg.train.parallel).name
    if env is None:
        raise LmforgeError(f"parallel.cp={cp} needs {cp} processes per model replica: launch with torchrun "
                           f"--nproc_per_node={cp} -m lmforge train ... or lmforge train --nproc {cp} ...")
    world_size, per_replica = env[1], cp * cfg.parallel.tp
    if world_size % per_replica:
        raise LmforgeError(f"parallel.cp={cp} on {world_size} processes: the world must be (replicas x cp x tp), "
                           f"a multiple of {per_replica}")
    if parallel == "none":
        raise LmforgeError(f"parallel.cp={cp} reduces the gradients over its {world_size} ranks (each cp rank a "
                           f"replica of its shard): set train.parallel=ddp, zero1, zero2, zero3 or fsdp")
    for setting, (refused, why) in CP_REFUSED.items():
        if refused(cfg):
            raise LmforgeError(f"parallel.cp={cp} does not combine with {setting}: {why}")
    if cfg.parallel.tp > 1:  # tp x cp: what tensor parallelism refuses, it refuses here too
        _check_tensor_parallel(cfg, env)
    if cfg.seq_len < 2 * cp:
        raise LmforgeError(f"parallel.cp={cp} cuts train.seq_len={cfg.seq_len} into 2 x cp = {2 * cp} chunks "
                           f"(lengths that are not a multiple are padded): use train.seq_len >= {2 * cp}")


def _rank_device(name: str, local_rank: int, cuda_devices: int) -> torch.device:
    """The device of train.device=`name` for the rank LOCAL_RANK=`local_rank` under torchrun."""
    if name == "auto":
        name = "cuda" if cuda_devices else "cpu"
    if not name.startswith("cuda"):
        return resolve_device(name)
    if name != "cuda":
        raise LmforgeError(f"train.device={name} under torchrun: each rank takes its own GPU "
                           f"(cuda:LOCAL_RANK); use train.device=cuda or auto")
    if cuda_devices == 0:
        raise LmforgeError("train.device=cuda under torchrun but no CUDA device is available: "
                           "use train.device=cpu (gloo)")
    if local_rank >= cuda_devices:
        raise LmforgeError(f"LOCAL_RANK {local_rank} but this node has {cuda_devices} CUDA device(s): start at "
                           f"most {cuda_devices} processes per node (--nproc_per_node={cuda_devices})")
    return torch.device("cuda", local_rank)
