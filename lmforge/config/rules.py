"""What combines with what: the one table of the settings lmforge refuses together (strategy x the
mesh's degrees x precision x training kind x pipeline x optimizer x compile x sequence parallelism
...), each refusal written once, in the one line the user reads.

Everyone asks here: config validation (config/validate.py runs `check_config`, the rules that hold
whatever the launch), the launch (parallel/world.py's `check_launch` runs `check_composition`
with the world torchrun started, before any process group or file exists), `lmforge plan`, and the
composition page (tests/composition_matrix.py writes docs/composition.md from these verdicts).
What is refused is what the engines cannot build or have never been shown to train; each entry
says why: `check_composition` raises the first refusal's line (`check_nproc` first for `--nproc N`).
Torch-free, like the rest of config/.
"""

from lmforge.common.errors import LmforgeError
from lmforge.config.schema import Degrees, mesh_degrees
from lmforge.modes import DATA_PARALLEL, PARAMETER_SHARDING, REPLICATING, SHARDING, STAGE_REPLICAS, names, parse_split


def check_composition(cfg, world: int | None) -> None:
    """LmforgeError (one line) for the first setting that does not combine with the others or with a
    launch of `world` processes (None: one process, no torchrun)."""
    check_config(cfg)
    _check_optimizer(cfg)
    p, parallel, stages = cfg.parallel, cfg.train.parallel, cfg.parallel.pp
    if world is not None and (p.dp_replicate or p.dp_shard):
        _check_world_degrees(cfg, world)
    if p.sequence_parallel and p.tp == 1:
        _refuse("parallel.sequence_parallel=true splits the tokens over the tensor-parallel ranks: set parallel.tp > 1")
    if p.cp > 1:
        return _check_context_parallel(cfg, world)
    if p.tp > 1:
        _check_tensor_parallel(cfg, world)
        return _check_pipeline(cfg, world) if stages > 1 else None  # pipelines of tensor-parallel stages
    if world is None:
        if stages > 1:
            _refuse(f"parallel.pp={stages} needs one process per stage: {_launch(stages)}")
        if parallel != "none":
            _refuse(f"train.parallel={parallel} needs one process per device: {_launch('N')} (or set "
                    f"train.parallel=none for one process)")
    elif stages > 1:
        _check_pipeline(cfg, world)
    elif parallel == "none" and world > 1:
        # Refused rather than guessed: the strategies differ in memory and speed, and N ranks
        # training alone would write one folder N times.
        _refuse(f"train.parallel=none under torchrun with {world} processes: choose how they share the work, "
                f"e.g. train.parallel=ddp (or {', '.join(SHARDING)})")


def check_nproc(cfg, nproc: int) -> None:
    """`lmforge train --nproc N`: a way to share the work over N processes, then check_composition."""
    if cfg.train.parallel == "none" and cfg.parallel.pp == 1 and cfg.parallel.tp == 1:
        _refuse(f"--nproc {nproc} needs a way to share the work: add train.parallel=ddp "
                f"(or {', '.join(SHARDING)}), or parallel.tp={nproc}")
    check_composition(cfg, nproc)


def _refuse(line: str) -> None:
    raise LmforgeError(line)


def _launch(processes) -> str:
    """How to start a run of `processes` (a number, or N) processes per node."""
    return (f"launch with torchrun --nproc_per_node={processes} -m lmforge train ... or lmforge train "
            f"--nproc {processes} ...")


# -- whatever the launch (config/validate.py runs these on every config it makes) ------------------

def check_config(cfg) -> None:
    """The refusals that need no world size: the degrees given against the strategy, a pipeline's
    shape and accumulation, in-loop task scores on a split model, compile with the attention kernels."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.dp_replicate and p.dp_shard:
        _check_degrees(cfg, Degrees(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp))
    if p.pp > 1 or t.pipeline_split:
        parse_split(t.pipeline_split, m.n_layers, p.pp)  # raises on a split that does not fit
    _check_interleaved(p.pp, t, m)
    if p.pp == 1 and t.micro_batches != 1:
        _refuse(f"train.micro_batches={t.micro_batches} applies to pipelines (parallel.pp > 1); "
                f"to accumulate gradients over micro-batches in one process use train.grad_accum")
    if p.pp > 1 and t.grad_accum != 1:
        _refuse(f"train.grad_accum={t.grad_accum} with parallel.pp={p.pp}: a pipeline "
                f"accumulates over its micro-batches; set train.micro_batches instead")
    split = [f"train.parallel={t.parallel}"] * (t.parallel in PARAMETER_SHARDING) + [
        f"parallel.{key}={getattr(p, key)}" for key in ("tp", "cp", "pp") if getattr(p, key) > 1]
    if t.eval_tasks.strip(" ,") and split:  # scored on every replica's whole model (train/evaluate.py)
        _refuse(f"train.eval_tasks scores on every replica's whole model, which {' and '.join(split)} splits: "
                f"use train.parallel=ddp (or zero1, zero2), or lmforge eval on a checkpoint")
    # the Triton kernels under torch.compile have never run (no GPU here): not offered untried
    if t.compile and m.attention == "flash_triton":
        _refuse("train.compile=true with model.attention=flash_triton is untested (its Triton kernels have never "
                "been traced by torch.compile): use model.attention=sdpa or train.compile=false")


def _check_interleaved(p: int, t, m) -> None:
    """train.schedule=interleaved-1f1b: p x v equal chunks, rounds of p micro-batches (Megatron-LM's rules)."""
    v = t.pipeline_virtual_stages
    if t.schedule != "interleaved-1f1b":
        return None if v == 1 else _refuse(f"train.pipeline_virtual_stages={v} applies to "
                                           f"train.schedule=interleaved-1f1b, not {t.schedule}")
    if m.n_layers % (p * v):
        _refuse(f"train.schedule=interleaved-1f1b cuts the model.n_layers={m.n_layers} layers into {p} stages x "
                f"{v} virtual stages = {p * v} equal chunks: use a number of layers divisible by {p * v}, or "
                f"other stages")
    if t.micro_batches % p:
        _refuse(f"train.schedule=interleaved-1f1b runs micro-batches in rounds of parallel.pp={p}: "
                f"train.micro_batches={t.micro_batches} must be a multiple of {p}")
    if t.pipeline_split.strip():
        _refuse(f"train.pipeline_split={t.pipeline_split} with train.schedule=interleaved-1f1b: its chunks are "
                f"equal; leave it unset")


def _check_degrees(cfg, d: Degrees) -> None:
    """What the data-parallel degrees (given, or inferred from the world) do not combine with."""
    hybrid = f"parallel.dp_replicate={d.dp_replicate} x parallel.dp_shard={d.dp_shard} (hybrid sharding)"
    if d.hybrid and cfg.train.parallel != "fsdp":
        _refuse(f"{hybrid} runs on FSDP2's 2-D mesh, not lmforge's ZeRO: set train.parallel=fsdp")
    if d.hybrid and d.cp > 1:
        _refuse(f"{hybrid} does not combine with parallel.cp={d.cp} yet: the cp ranks' dp x cp group is 1-D")
    if d.dp_replicate > 1 and d.dp_shard == 1 and cfg.train.parallel in SHARDING:
        _refuse(f"parallel.dp_shard=1 with train.parallel={cfg.train.parallel} shards over one rank: use "
                f"train.parallel=ddp, or parallel.dp_shard > 1")


def _check_optimizer(cfg) -> None:
    """An optimizer that needs whole matrices where the strategy shards them in a way it cannot use
    (docs/optimizers.md's "where each runs" says what is tested where)."""
    name, tp, parallel = cfg.optim.name, cfg.parallel.tp, cfg.train.parallel
    if name == "adafactor" and tp > 1:
        _refuse(f"optim.name=adafactor does not combine with parallel.tp={tp}: its factored second moment needs "
                f"each whole matrix's row and column sums and each tensor rank holds a slice; use another "
                f"optimizer (adamw, muon, lion, ...) or parallel.tp=1")
    # Muon gathers each split matrix over the tp group (parallel/tp_engine.py's TensorParallelMatrices)
    # where the optimizer holds whole tp slices: a replicating strategy, one stage, no cp
    if name == "muon" and tp > 1 and (parallel not in REPLICATING or cfg.parallel.cp > 1
                                      or cfg.parallel.pp > 1):
        where = (f"train.parallel={parallel}" if parallel not in REPLICATING else
                 f"parallel.cp={cfg.parallel.cp}" if cfg.parallel.cp > 1 else
                 f"parallel.pp={cfg.parallel.pp}")
        _refuse(f"optim.name=muon does not combine with parallel.tp={tp} and {where}: Newton-Schulz gathers each "
                f"matrix over the tensor ranks only under train.parallel={names(REPLICATING)}, without cp or "
                f"pipeline stages; use one of those or parallel.tp=1")
    if name == "adafactor" and parallel in SHARDING:
        _refuse(f"optim.name=adafactor does not combine with train.parallel={parallel}: its second moment is "
                f"factored by each matrix's rows and columns, which {parallel}'s flat shards do not keep; use "
                f"train.parallel=ddp")
    if name == "muon" and parallel == "fsdp":
        _refuse("optim.name=muon does not combine with train.parallel=fsdp: Newton-Schulz needs whole matrices, "
                "gathered from ZeRO's flat shards but not from FSDP's; use train.parallel=zero1, zero2, zero3 or ddp")


# -- against the world (parallel/world.py's check_launch) -----------------------------------------

def _check_world_degrees(cfg, world: int) -> None:
    """parallel.dp_replicate / dp_shard against the world: pp x dp_replicate x dp_shard x cp x tp ranks."""
    p, pp, cp, tp = cfg.parallel, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.tp
    if p.dp_replicate and p.dp_shard:
        product = pp * p.dp_replicate * p.dp_shard * cp * tp
        if product != world:
            _refuse(f"pp {pp} x dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {cp} x tp {tp} = "
                    f"{product} ranks, but the world is {world}: launch {product} processes or change the degrees")
    elif world % (pp * cp * tp):
        _refuse(f"the world of {world} ranks is not a multiple of pp {pp} x cp {cp} x tp {tp} = {pp * cp * tp}: "
                f"launch a multiple of {pp * cp * tp} processes")
    else:
        key, value = ("dp_replicate", p.dp_replicate) if p.dp_replicate else ("dp_shard", p.dp_shard)
        dp, sharding = world // (pp * cp * tp), cfg.train.parallel in SHARDING
        if dp % value or (key == "dp_replicate" and not sharding and value != dp):
            _refuse(f"parallel.{key}={value} must {'divide' if sharding else 'equal'} the {dp} data-parallel "
                    f"ranks (world {world} / (pp {pp} x cp {cp} x tp {tp})): launch {value * pp * cp * tp} "
                    f"processes (or a multiple) or change parallel.{key}")
    _check_degrees(cfg, mesh_degrees(cfg, world))


# why each strategy a pipeline's replicas cannot take is refused: a pipeline step runs one backward
# per micro-batch (m of them); the rest are STAGE_REPLICAS
PIPELINE_REFUSED = {
    "zero2": "ZeRO-2 would reduce-scatter each gradient m times a step, or keep it whole (ZeRO-1's memory)",
    "zero3": "ZeRO-3 would gather each block 2m times a step, not 2, or keep it gathered",
    "fsdp": "FSDP would gather each block 2m times a step, not 2 (as ZeRO-3)",
}


def _check_pipeline(cfg, world: int) -> None:
    """What a pipeline of parallel.pp stages on `world` ranks cannot do."""
    t, tp = cfg.train, cfg.parallel.tp
    p, parallel = cfg.parallel.pp, t.parallel
    launch = (f"launch with torchrun --nproc_per_node={p * tp} -m lmforge train ... (or lmforge train --nproc "
              f"{p * tp} ...)")
    if world < p * tp or world % (p * tp):
        per_stage = "one process per stage" if tp == 1 else f"parallel.tp={tp} processes per stage"
        _refuse(f"parallel.pp={p} needs {per_stage} (or a multiple of {p * tp}: replicas), not {world}: "
                f"{launch}")
    replicas = world // (p * tp)
    if parallel not in STAGE_REPLICAS:
        _refuse(f"train.parallel={parallel} does not combine with parallel.pp={p}: "
                f"{PIPELINE_REFUSED[parallel]}; use train.parallel=zero1 (shards each stage's optimizer states) or ddp")
    if replicas > 1 and parallel == "none":
        _refuse(f"{world} ranks = {p} stages x {replicas} replicas: choose how each stage's replicas share its "
                f"gradients: train.parallel=ddp or zero1")
    if t.precision == "fp16-mixed" and t.pipeline_engine == "torch":
        _refuse("train.pipeline_engine=torch does not scale the loss (fp16-mixed): use train.pipeline_engine=lmforge "
                "or bf16-mixed")
    if tp > 1 and cfg.parallel.sequence_parallel and t.pipeline_engine == "torch":
        _refuse(f"parallel.pp={p} with parallel.tp={tp} does not combine with parallel.sequence_parallel: "
                f"train.pipeline_engine=torch's stages with sequence shards are untested: use "
                f"train.pipeline_engine=lmforge or parallel.sequence_parallel=false")


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


def _check_tensor_parallel(cfg, world: int | None) -> None:
    """parallel.tp > 1: world = (world / tp) replicas x tp ranks (parallel/mesh.py; with pipeline stages,
    stages x replicas x tp), the replicas under a data-parallel strategy (or none with one replica),
    and a model the ranks can split."""
    tp, parallel, stages = cfg.parallel.tp, cfg.train.parallel, cfg.parallel.pp
    if world is None:
        _refuse(f"parallel.tp={tp} needs {tp} processes per model replica: {_launch(tp)}")
    if world % (tp * stages):
        _refuse(f"parallel.tp={tp} on {world} processes: the world must be (replicas x tp), a multiple of {tp}"
                if stages == 1 else f"parallel.pp={stages} x parallel.tp={tp} on {world} processes: "
                f"the world must be (stages x replicas x tp), a multiple of {stages * tp}")
    dp = world // (tp * stages)
    if dp > 1 and parallel == "none":
        _refuse(f"{world} processes = {dp} replicas x parallel.tp={tp}: the replicas share their gradients by "
                f"train.parallel={names(DATA_PARALLEL)} (or none with one replica), not {parallel}")
    for setting, (refused, why) in TP_REFUSED.items():
        if refused(cfg):
            _refuse(f"parallel.tp={tp} does not combine with {setting}: {why}")
    reason = tp_divisibility(cfg.model, tp)
    if reason:
        _refuse(reason)
    if cfg.parallel.sequence_parallel:
        if cfg.model.family == "gpt":
            _refuse("parallel.sequence_parallel=true with model.family=gpt: its learned positions are added to the "
                    "whole sequence (not written); use the llama family")
        if cfg.seq_len % tp and cfg.parallel.cp == 1:  # with cp, each cp shard is padded to a multiple of tp
            _refuse(f"parallel.sequence_parallel=true splits train.seq_len={cfg.seq_len} over parallel.tp={tp} "
                    f"ranks: use a multiple of {tp}")


# what context parallelism (parallel/cp_model.py) is not combined with yet, and why: setting -> (refused when, why)
CP_REFUSED = {
    "parallel.pp": (lambda c: c.parallel.pp > 1, "pipelines of context-parallel stages are not wired"),
    "model.dropout": (lambda c: c.model.dropout > 0, "ring attention has no dropout, and per-rank masks would not "
                                                     "match one process's: set model.dropout=0"),
    "model.sliding_window": (lambda c: c.model.sliding_window is not None, "the ring's masks are the causal ones"),
    "train.loss_chunk_tokens": (lambda c: c.train.loss_chunk_tokens > 0,
                                "the chunked loss would replace the group's loss (each rank already holds 1/cp of "
                                "the logits)"),
    "train.sample_tokens": (lambda c: c.train.sample_tokens > 0,
                            "generation needs a KV cache, which the ring does not keep: set train.sample_tokens=0"),
}


def _check_context_parallel(cfg, world: int | None) -> None:
    """parallel.cp > 1: world = dp replicas x cp ranks (parallel/mesh.py), gradients reduced over
    them by a data-parallel strategy (parallel/engine.py, over the dp x cp group), sequences long enough to shard."""
    cp = cfg.parallel.cp
    if world is None:
        _refuse(f"parallel.cp={cp} needs {cp} processes per model replica: {_launch(cp)}")
    if world % (cp * cfg.parallel.tp):
        _refuse(f"parallel.cp={cp} on {world} processes: the world must be (replicas x cp x tp), a multiple of "
                f"{cp * cfg.parallel.tp}")
    if cfg.train.parallel == "none":
        _refuse(f"parallel.cp={cp} reduces the gradients over its {world} ranks (each cp rank a replica of its "
                f"shard): set train.parallel={names(DATA_PARALLEL)}")
    for setting, (refused, why) in CP_REFUSED.items():
        if refused(cfg):
            _refuse(f"parallel.cp={cp} does not combine with {setting}: {why}")
    if cfg.parallel.tp > 1:  # tp x cp: what tensor parallelism refuses, it refuses here too
        _check_tensor_parallel(cfg, world)
    if cfg.seq_len < 2 * cp:
        _refuse(f"parallel.cp={cp} cuts train.seq_len={cfg.seq_len} into 2 x cp = {2 * cp} chunks (lengths that "
                f"are not a multiple are padded): use train.seq_len >= {2 * cp}")
