"""The `parallel` section's degrees, resolved in one place: pp x dp_replicate x dp_shard x cp x tp
(torchtitan's ParallelDims, torchtitan/distributed/parallel_dims.py, is the model: the same names
and order, and a degree left unset inferred from the world size).

Two steps. `resolve_degrees` (run first by config/validate.py's validate) turns the data-parallel
degrees into the strategy the engines read, and says what it changed:

    parallel.dp_shard=N > 1   the data-parallel ranks shard the model states: train.parallel none
                              or ddp becomes fsdp; zero1-3 and fsdp stay
    parallel.dp_replicate=N   alone (> 1): the data-parallel ranks replicate: none becomes ddp
    both > 1                  hybrid sharding (HSDP; Zhao et al. 2023, "PyTorch FSDP", section
                              3.2.2): FSDP2 over a (dp_replicate, dp_shard) mesh, shards within a
                              shard group, gradients all-reduced across the replicate groups

`mesh_degrees` gives the five degrees of a launch on a world of ranks (parallel/mesh.py builds the
mesh from them). parallel.pp is the pipeline's stages (train.pipeline_stages, its older name, is
read as an alias by config/load.py). 0 means "not set": the data-parallel degree is then inferred as
today, world / (pp x cp x tp). What the degrees do not combine with (the product against the world, hybrid
sharding's strategy) is config/rules.py's.
"""

from dataclasses import dataclass

from lmforge.common.errors import LmforgeError
from lmforge.modes import REPLICATING, SHARDING


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
    """Set train.parallel from parallel.dp_replicate and dp_shard; the changes made, one line each (for
    a warning); LmforgeError for a degree that is no whole number."""
    p, t = cfg.parallel, cfg.train
    for key in ("dp_replicate", "dp_shard"):
        value = getattr(p, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LmforgeError(f"parallel.{key} must be a whole number >= 1 (0: inferred), got {value!r}")
    notes = []
    if p.dp_shard > 1 and t.parallel in REPLICATING:
        notes.append(f"parallel.dp_shard={p.dp_shard} shards the model states over the data-parallel ranks: "
                     f"train.parallel={t.parallel} becomes fsdp")
        t.parallel = "fsdp"
    elif p.dp_replicate > 1 and p.dp_shard <= 1 and t.parallel == "none":
        notes.append(f"parallel.dp_replicate={p.dp_replicate} replicates the model: train.parallel=none "
                     f"becomes ddp")
        t.parallel = "ddp"
    return notes


def mesh_degrees(cfg, world: int) -> Degrees:
    """The launch's five degrees on `world` ranks, those not given inferred (config/rules.py has
    already refused degrees that do not multiply to the world)."""
    p = cfg.parallel
    pp, cp, tp = p.pp, p.cp, p.tp
    if p.dp_replicate and p.dp_shard:
        return Degrees(pp, p.dp_replicate, p.dp_shard, cp, tp)
    dp = world // (pp * cp * tp)
    if p.dp_replicate:
        return Degrees(pp, p.dp_replicate, dp // p.dp_replicate, cp, tp)
    if p.dp_shard:
        return Degrees(pp, dp // p.dp_shard, p.dp_shard, cp, tp)
    sharding = cfg.train.parallel in SHARDING  # as before the degrees: a sharding strategy shards over every dp rank
    return Degrees(pp, 1 if sharding else dp, dp if sharding else 1, cp, tp)
