"""The composition matrix (issue 26): each way of laying the ranks out x each precision policy x
each kind of training, and each layout with torch.compile, recomputation and a resume; for every
cell either "works" or the one line that refuses it before launch.

Nothing is decided here. A cell's verdict is the real checks' (DESIGN.md, "Everything allowed
composes"): its config is made and validated as `lmforge train` makes it (config/load.py's
`make_config`, which runs config/validate.py), then lmforge/config/rules.py's `check_composition`
is asked with the layout's world (what parallel/world.py's `check_launch` asks before any process
group or file exists). A rule that changes changes the table.

Which test trains each working cell is tests/composition_coverage.py's `COVERAGE`; the table marks
the rest "works, untested" (the data-parallel dist tests cover the product pairwise: see
docs/composition.md; every pipeline cell is trained).

    python tests/composition_matrix.py > docs/composition.md    regenerate the page
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# the dist tests read the cells and their coverage through this module
from composition_coverage import CELLS, COVERAGE, DIST, TPCELLS, tests_of  # noqa: E402, F401

from lmforge.common.errors import LmforgeError  # noqa: E402
from lmforge.config import make_config  # noqa: E402
from lmforge.config.rules import check_composition  # noqa: E402
from lmforge.modes import DATA_PARALLEL, POLICIES, RECOMPUTE_MODES, SHARDING

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
    cp: int = 1  # parallel.cp: ranks per context-parallel group (no end-of-run sample: config/rules.py's CP_REFUSED)
    settings: tuple[str, ...] = ()  # more overrides that make the layout (sequence parallelism, one KV head)

    @property
    def overrides(self) -> list[str]:
        piped = [f"parallel.pp={self.stages}", f"train.micro_batches={self.stages}"] * (self.stages > 1)
        tensor = [f"parallel.tp={self.tp}"] if self.tp > 1 else []
        context = [f"parallel.cp={self.cp}", "train.sample_tokens=0"] if self.cp > 1 else []
        return [f"train.parallel={self.parallel}", *piped, *tensor, *context, *self.settings]

    @property
    def world(self) -> int | None:
        """The processes torchrun starts; None: one process, no torchrun."""
        return None if self.ranks == 1 else self.ranks


SP, ONE_KV_HEAD = "parallel.sequence_parallel=true", "model.n_kv_heads=1"
HSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=2")  # hybrid sharding: FSDP2's 2-D mesh (parallel/mesh.py)


def layouts() -> list[Layout]:
    """One process, each strategy on 2 ranks, a 2-stage pipeline, and the pipeline with 2 replicas
    under each strategy (4 ranks): every strategy modes/ names, with and without stages;
    tensor parallelism on 2 ranks, and 2 of them as replicas under each strategy (4 ranks); context
    parallelism on 2 ranks, 2 of them as ddp replicas, and tp=2 x cp=2 (4 ranks each), and the
    sharding strategies over dp=2 x cp=2 and over tp=2 x cp=2's cp ranks (4 ranks each); tp=4 over
    the model's 2 KV heads (parallel/tp.py replicates each on 2 ranks), and tp=2 over one KV head
    under cp and under fsdp, and tp=2 x cp=2 with sequence parallelism (4 ranks each); pipelines of
    tp=2 stages (4 ranks), their stages replicated under ddp or zero1 (8 ranks: pp x dp x tp)."""
    return ([Layout("one process", "none")] + [Layout(s, s, 1, 2) for s in DATA_PARALLEL]
            + [Layout("pipeline", "none", STAGES, STAGES)]
            + [Layout(f"pipeline x {s}", s, STAGES, 2 * STAGES) for s in DATA_PARALLEL]
            + [Layout("tp", "none", 1, 2, tp=2)] + [Layout(f"tp x {s}", s, 1, 4, tp=2) for s in DATA_PARALLEL]
            + [Layout("pipeline x tp", "none", STAGES, 2 * STAGES, tp=2)]
            + [Layout(f"pipeline x tp x {s}", s, STAGES, 4 * STAGES, tp=2) for s in ("ddp", "zero1")]
            + [Layout("cp", "ddp", 1, 2, cp=2), Layout("cp x ddp", "ddp", 1, 4, cp=2),
               Layout("tp x cp", "ddp", 1, 4, tp=2, cp=2)]
            + [Layout(f"cp x {s}", s, 1, 4, cp=2) for s in SHARDING]
            + [Layout(f"tp x cp x {s}", s, 1, 4, tp=2, cp=2) for s in SHARDING]
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
        check_composition(cfg, layout.world)
    except LmforgeError as err:
        return str(err)
    return None


# -- the page -------------------------------------------------------------------------------------

SHORT_KINDS = {"pretraining": "pre", "full fine-tuning": "full FT", "LoRA": "LoRA"}


class Notes:
    """Footnote labels in order of first use: t1, t2, ... for tests, r1, r2, ... for refusals."""

    def __init__(self, prefix: str):
        self.prefix, self.items = prefix, {}

    def label(self, text: str) -> str:
        return self.items.setdefault(text, f"{self.prefix}{len(self.items) + 1}")

    def lines(self, quote) -> list[str]:
        return [f"- **{label}** {quote(text)}" for text, label in self.items.items()]


def cell(layout: Layout, precision: str, kind: str, extra, tests: Notes, refusals: Notes) -> str:
    refused = verdict(layout, precision, kind, extra)
    if refused is not None:
        return f"✗ {refusals.label(refused)}"
    covering = tests_of(layout.name, precision, kind, extra)
    if covering:
        return "✓ " + ",".join(tests.label(t) for t in covering)
    return "ref" if layout.ranks == 1 and extra is None else "✓ -"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def page() -> str:
    """docs/composition.md."""
    tests, refusals = Notes("t"), Notes("r")
    columns = [(p, k) for p in PRECISIONS for k in KINDS]
    main = table(["layout (ranks)"] + [f"{p} {SHORT_KINDS[k]}" for p, k in columns],
                 [[f"{l.name} ({l.ranks})"] + [cell(l, p, k, None, tests, refusals) for p, k in columns]
                  for l in LAYOUTS.values()])
    extras = table(["layout (ranks), fp32 pretraining"] + list(EXTRAS),
                   [[f"{l.name} ({l.ranks})"] + [cell(l, "fp32", "pretraining", e, tests, refusals) for e in EXTRAS]
                    for l in LAYOUTS.values()])
    return "\n".join([*HEAD, "", *main, "", *MIDDLE, "", *extras, "", "Tests:", "",
                      *tests.lines(lambda t: f"`{t}`"), "", "Refusals, each the one line the launch stops with:", "",
                      *refusals.lines(lambda r: r), "", *TAIL]) + "\n"


HEAD = ["# What composes with what",
        "",
        "<!-- generated by `python tests/composition_matrix.py > docs/composition.md`; tests/test_composition.py",
        "     fails when this file differs from what the checks say now -->",
        "",
        "Every way of laying out the ranks, in every precision policy, for every kind of training: each cell",
        "either trains (a dist test trains it a few steps to one process's numbers on the same global batch,",
        "with the bytes each rank holds equal to the plan's) or is refused before any process group or file",
        "exists, with the one line below. The verdicts are the real checks' (`tests/composition_matrix.py`",
        "makes each cell's config with `make_config`, which validates it, and asks `lmforge/config/rules.py`,",
        "the one table of what combines, with the layout's world), on the `tiny` model, so the table changes",
        "when they do.",
        "",
        "`✓ tN`: works, trained by test tN; `✓ -`: passes the checks, trained by no test (the tests cover",
        "the product pairwise: each strategy with each precision, each kind with each precision and each",
        "strategy, not every triple); `ref`: one process, the reference the others are compared with;",
        "`✗ rN`: refused with line rN. pre: pretraining; full FT: every weight of a base trains, on",
        "examples whose prompts have no targets; LoRA: rank-4 adapters on a frozen base.",
        "",
        "Regenerate: `python tests/composition_matrix.py > docs/composition.md`. Run the dist tests:",
        "`python -m pytest -m dist tests/test_composition_dist.py` (one torchrun launch of 2 ranks, 53 cells:",
        "4m08s on the 2 CPU cores shared with other work). Where this ran: the 2-core CPU VM, gloo; no GPU",
        "(fp8 simulated: precision/fp8.py)."]
MIDDLE = ["With torch.compile, recomputation and checkpoints, each in fp32 pretraining. The state",
          "round trip (test_every_strategys_state_loads_back_by_name) loads each strategy's model and",
          "optimizer state by name into a fresh engine; the resume tests of test_distributed_train.py",
          "run `lmforge train --resume` under torchrun."]
TAIL = ["Tolerances (tests/test_composition_dist.py says why): fp32 as float rounding of the summation",
        "order (tests/test_parallel_engines.py); 16-bit policies: losses 1e-3, the first gradient norm 1e-3,",
        "an update within 15% of one process's; fp8: 5e-3, 3e-2, 50%, each several times below what training",
        "on other rows gives. Bytes: parameters, gradients, master weights and optimizer states per rank as",
        "`accounting/memory.py`'s `model_state_bytes` predicts them, equal in every cell trained here",
        "(FSDP keeps the policy's own fp32 shards; ZeRO keeps a LoRA base whole on every rank).",
        "",
        "Pipelines: tests/test_pipeline_cells_dist.py trains every pipeline cell (one launch of 2 ranks, one",
        "of 4) with the same bounds (a pipeline alone in 16 bits drifts from one process once the tied",
        "matrix's last-bit sum flips a 16-bit rounding: its docstring measures it); its resume cells are",
        "state round trips, and `lmforge train` on 2 stages x 2 ZeRO-1 replicas stopped by SIGTERM resumes",
        "bit for bit. Run: `python -m pytest -m dist tests/test_pipeline_cells_dist.py`.",
        "",
        "Tensor and context parallelism: tests/test_tp_cells_dist.py trains the tp and cp rows' cells the",
        "older tests leave (one launch of 2 ranks, one of 4, 100 cells) with the same bounds, LoRA in 16 bits",
        "wider (first norm 5e-3, update 0.3: its docstring measures them); its resume cells are state round",
        "trips; tp x zero3 compiled is its slow test (the other tp and cp rows' compiled cells are untested:",
        "~2 min a 4-rank compiled cell here). Run: `python -m pytest -m dist tests/test_tp_cells_dist.py`.",
        "",
        "Pipelines of tensor-parallel stages (2 stages x tp 2, and x 2 replicas on 8 ranks):",
        "tests/test_tp_pipeline_dist.py, tensor parallelism's bounds (docs/tensor-parallel.md), interleaved",
        "1F1B (2 chunks per rank), sequence parallelism and the torch engine too; on each of the 4 ranks the",
        "parameters, gradients, optimizer states and the bytes sent (between stages, the tied sum, the",
        "tensor-parallel collectives) equal lmforge plan's figures for its stage exactly, and the saved",
        "activations to the loss's 8 bytes (lmforge's engine; the torch engine's loss takes whole logits).",
        "",
        "Not in the table: `train.pipeline_engine=torch` with fp16-mixed is refused (it does not scale the",
        "loss); interleaved 1F1B compiled and in bf16-mixed, and the torch engine with ZeRO-1 replicas,",
        "LoRA and a full fine-tune are trained by tests/test_pipeline_cells_dist.py (as are interleaved",
        "fp32, recomputed and replicated by tests/test_pipeline_interleaved_dist.py)."]

if __name__ == "__main__":
    sys.stdout.write(page())
