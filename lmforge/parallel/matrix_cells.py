"""The composition matrix's cells (docs/composition.md): each way of laying the ranks out (a
`Layout`), each precision policy, each kind of training, and the second table's extra settings;
a cell's verdict is the launch checks' own (parallel/matrix.py's docstring says how).
"""

from dataclasses import dataclass

from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.modes.parallel import PARALLEL_STRATEGIES
from lmforge.modes.precision import POLICIES
from lmforge.modes.recompute import RECOMPUTE_MODES
from lmforge.parallel.launch import check_launch

PRESET = "tiny"  # the model every cell is checked (and tested) on: 2 layers, so at most 2 stages
STAGES = 2
BASE = "runs/base"  # a fine-tuning base: its path is read when the run prepares, after these checks


@dataclass(frozen=True)
class Layout:
    """A row: train.parallel on `ranks` processes, cut into `stages` pipeline stages."""
    name: str
    parallel: str
    stages: int = 1
    ranks: int = 1
    tp: int = 1  # parallel.tp: ranks per tensor-parallel group
    cp: int = 1  # parallel.cp: ranks per context-parallel group (no end-of-run sample: launch.py's CP_REFUSED)
    settings: tuple[str, ...] = ()  # more overrides that make the layout (sequence parallelism, one KV head)

    @property
    def overrides(self) -> list[str]:
        piped = [f"train.pipeline_stages={self.stages}", f"train.micro_batches={self.stages}"] if self.stages > 1 else []
        tensor = [f"parallel.tp={self.tp}"] if self.tp > 1 else []
        context = [f"parallel.cp={self.cp}", "train.sample_tokens=0"] if self.cp > 1 else []
        return [f"train.parallel={self.parallel}", *piped, *tensor, *context, *self.settings]

    @property
    def env(self) -> tuple[int, int, int] | None:
        """(RANK, WORLD_SIZE, LOCAL_RANK) of rank 0 under torchrun; None: no torchrun."""
        return None if self.ranks == 1 else (0, self.ranks, 0)


SP, ONE_KV_HEAD = "parallel.sequence_parallel=true", "model.n_kv_heads=1"
HSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=2")  # hybrid sharding: FSDP2's 2-D mesh (parallel/mesh.py)
SHARDED = ("zero1", "zero2", "zero3", "fsdp")  # the strategies that shard model states


def layouts() -> list[Layout]:
    """One process, each strategy on 2 ranks, a 2-stage pipeline, and the pipeline with 2 replicas
    under each strategy (4 ranks): every strategy modes/parallel.py names, with and without stages;
    tensor parallelism on 2 ranks, and 2 of them as replicas under each strategy (4 ranks); context
    parallelism on 2 ranks, 2 of them as ddp replicas, and tp=2 x cp=2 (4 ranks each), and the
    sharding strategies over dp=2 x cp=2 and over tp=2 x cp=2's cp ranks (4 ranks each); tp=4 over
    the model's 2 KV heads (parallel/tp.py replicates each on 2 ranks), and tp=2 over one KV head
    under cp and under fsdp, and tp=2 x cp=2 with sequence parallelism (4 ranks each); pipelines of
    tp=2 stages (4 ranks), their stages replicated under ddp or zero1 (8 ranks: pp x dp x tp)."""
    strategies = [name for name in PARALLEL_STRATEGIES if name != "none"]
    return ([Layout("one process", "none")] + [Layout(s, s, 1, 2) for s in strategies]
            + [Layout("pipeline", "none", STAGES, STAGES)]
            + [Layout(f"pipeline x {s}", s, STAGES, 2 * STAGES) for s in strategies]
            + [Layout("tp", "none", 1, 2, tp=2)] + [Layout(f"tp x {s}", s, 1, 4, tp=2) for s in strategies]
            + [Layout("pipeline x tp", "none", STAGES, 2 * STAGES, tp=2)]
            + [Layout(f"pipeline x tp x {s}", s, STAGES, 4 * STAGES, tp=2) for s in ("ddp", "zero1")]
            + [Layout("cp", "ddp", 1, 2, cp=2), Layout("cp x ddp", "ddp", 1, 4, cp=2),
               Layout("tp x cp", "ddp", 1, 4, tp=2, cp=2)]
            + [Layout(f"cp x {s}", s, 1, 4, cp=2) for s in SHARDED]
            + [Layout(f"tp x cp x {s}", s, 1, 4, tp=2, cp=2) for s in SHARDED]
            + [Layout("tp=4, KV heads replicated", "none", 1, 4, tp=4),  # tiny's 2 KV heads, each on 2 ranks
               Layout("tp x cp, sequence parallel", "ddp", 1, 4, tp=2, cp=2, settings=(SP,)),
               Layout("tp x cp, 1 KV head", "ddp", 1, 4, tp=2, cp=2, settings=(ONE_KV_HEAD,)),
               Layout("tp x fsdp, 1 KV head", "fsdp", 1, 4, tp=2, settings=(ONE_KV_HEAD,)),
               Layout("hsdp: dp_replicate 2 x dp_shard 2", "fsdp", 1, 4, settings=HSDP)])


LAYOUTS = {layout.name: layout for layout in layouts()}
PRECISIONS = tuple(POLICIES)
# what each kind of training sets (a full fine-tune trains every weight of a base, LoRA adapters on it)
KINDS = {"pretraining": [], "full fine-tuning": [f"finetune.base={BASE}"],
         "LoRA": [f"finetune.base={BASE}", "finetune.lora_rank=4"]}
# the second table's columns: fp32 pretraining with one more setting (resume: no setting refuses it)
EXTRAS = {"compiled": ["train.compile=true"],
          **{f"recompute={mode}": [f"train.recompute={mode}"] for mode in RECOMPUTE_MODES if mode != "none"},
          "checkpoint + resume": []}


def cell_overrides(layout: Layout, precision: str, kind: str, extra: str | None = None) -> list[str]:
    return ["train.device=cpu", *layout.overrides, f"train.precision={precision}", *KINDS[kind],
            *(EXTRAS[extra] if extra else [])]


def verdict(layout: Layout, precision: str, kind: str = "pretraining", extra: str | None = None) -> str | None:
    """None if the cell passes every check a launch meets before it starts; else the refusal's line."""
    try:
        cfg = make_config(PRESET, overrides=cell_overrides(layout, precision, kind, extra))
        check_launch(cfg, layout.env, cuda_devices=0)
    except LmforgeError as err:
        return str(err)
    return None
