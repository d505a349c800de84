"""The `parallel` section's degrees, resolved in one place: pp x dp_replicate x dp_shard x cp x tp
(torchtitan's ParallelDims, torchtitan/distributed/parallel_dims.py, is the model: the same names
and order, and a degree left unset inferred from the world size).

Two steps. `resolve_degrees` (run first by config/validate.py's validate) turns the degrees into the
settings the engines read, and says what it changed:

    parallel.pp=P             sets train.pipeline_stages=P (both set and different: refused)
    parallel.dp_shard=N > 1   the data-parallel ranks shard the model states: train.parallel none
                              or ddp becomes fsdp; zero1-3 and fsdp stay
    parallel.dp_replicate=N   alone (> 1): the data-parallel ranks replicate: none becomes ddp
    both > 1                  hybrid sharding (HSDP; Zhao et al. 2023, "PyTorch FSDP", section
                              3.2.2): FSDP2 over a (dp_replicate, dp_shard) mesh, shards within a
                              shard group, gradients all-reduced across the replicate groups

`mesh_degrees` (run by parallel/launch.py's check_launch, which knows the world size) gives the
five degrees of a launch, the product checked against the world. 0 means "not set": the data-
parallel degree is then inferred as today, world / (pp x cp x tp).
"""

from dataclasses import dataclass

from lmforge.common.errors import LmforgeError

SHARDING = ("zero1", "zero2", "zero3", "fsdp")  # train.parallel values that shard the model states


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


def resolve_degrees(cfg) -> list[str]:
    """Set train.pipeline_stages and train.parallel from parallel.pp, dp_replicate and dp_shard;
    the changes made, one line each (for a warning); LmforgeError for degrees that contradict them."""
    p, t = cfg.parallel, cfg.train
    for key in ("pp", "dp_replicate", "dp_shard"):
        value = getattr(p, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LmforgeError(f"parallel.{key} must be a whole number >= 1 (0: inferred), got {value!r}")
    notes = []
    if p.pp:
        if t.pipeline_stages not in (1, p.pp):
            raise LmforgeError(f"parallel.pp={p.pp} and train.pipeline_stages={t.pipeline_stages} disagree: "
                               f"set one of them (parallel.pp is the pipeline's stages)")
        t.pipeline_stages = p.pp
    if p.dp_shard > 1 and t.parallel in ("none", "ddp"):
        notes.append(f"parallel.dp_shard={p.dp_shard} shards the model states over the data-parallel ranks: "
                     f"train.parallel={t.parallel} becomes fsdp")
        t.parallel = "fsdp"
    elif p.dp_replicate > 1 and p.dp_shard <= 1 and t.parallel == "none":
        notes.append(f"parallel.dp_replicate={p.dp_replicate} replicates the model: train.parallel=none "
                     f"becomes ddp")
        t.parallel = "ddp"
    if p.dp_replicate > 1 and p.dp_shard > 1 and t.parallel != "fsdp":
        raise LmforgeError(f"parallel.dp_replicate={p.dp_replicate} x parallel.dp_shard={p.dp_shard} (hybrid "
                           f"sharding) runs on FSDP2's 2-D mesh, not lmforge's ZeRO: set train.parallel=fsdp")
    if p.dp_replicate > 1 and p.dp_shard == 1 and t.parallel in SHARDING:
        raise LmforgeError(f"parallel.dp_shard=1 with train.parallel={t.parallel} shards over one rank: "
                           f"use train.parallel=ddp, or parallel.dp_shard > 1")
    return notes


def mesh_degrees(cfg, world: int) -> Degrees:
    """The launch's five degrees on `world` ranks; LmforgeError (one line naming the product and the
    world) when the degrees given do not multiply to it."""
    p = cfg.parallel
    pp, cp, tp = cfg.train.pipeline_stages, p.cp, p.tp
    given = {key: getattr(p, key) for key in ("dp_replicate", "dp_shard") if getattr(p, key)}
    if len(given) == 2:
        product = pp * p.dp_replicate * p.dp_shard * cp * tp
        if product != world:
            raise LmforgeError(f"pp {pp} x dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {cp} x tp "
                               f"{tp} = {product} ranks, but the world is {world}: launch {product} processes "
                               f"or change the degrees")
        return check_hybrid(cfg, Degrees(pp, p.dp_replicate, p.dp_shard, cp, tp))
    if world % (pp * cp * tp):
        raise LmforgeError(f"the world of {world} ranks is not a multiple of pp {pp} x cp {cp} x tp {tp} = "
                           f"{pp * cp * tp}: launch a multiple of {pp * cp * tp} processes")
    dp = world // (pp * cp * tp)
    if not given:  # today's inference: a sharding strategy shards over every data-parallel rank
        sharding = cfg.train.parallel in SHARDING
        return Degrees(pp, 1 if sharding else dp, dp if sharding else 1, cp, tp)
    (key, value), = given.items()
    sharding = cfg.train.parallel in SHARDING
    if dp % value or (key == "dp_replicate" and not sharding and value != dp):
        raise LmforgeError(f"parallel.{key}={value} must {'divide' if sharding else 'equal'} the {dp} data-parallel "
                           f"ranks (world {world} / (pp {pp} x cp {cp} x tp {tp})): launch "
                           f"{value * pp * cp * tp} processes (or a multiple) or change parallel.{key}")
    other = dp // value
    degrees = Degrees(pp, value, other, cp, tp) if key == "dp_replicate" else Degrees(pp, other, value, cp, tp)
    if sharding and degrees.dp_shard == 1:
        raise LmforgeError(f"parallel.dp_replicate={value} leaves dp_shard=1 (world {world}): train.parallel="
                           f"{cfg.train.parallel} would shard over one rank; use train.parallel=ddp")
    return check_hybrid(cfg, degrees)


def check_hybrid(cfg, d: Degrees) -> Degrees:
    """What hybrid sharding (dp_replicate and dp_shard both > 1) is not combined with."""
    if d.hybrid and cfg.train.parallel != "fsdp":
        raise LmforgeError(f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} (hybrid sharding) runs on "
                           f"FSDP2's 2-D mesh, not lmforge's ZeRO: set train.parallel=fsdp")
    if d.hybrid and d.cp > 1:
        raise LmforgeError(f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} (hybrid sharding) does not "
                           f"combine with parallel.cp={d.cp} yet: the cp ranks' dp x cp group is 1-D")
    return d
