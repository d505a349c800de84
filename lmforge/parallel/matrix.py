"""The composition matrix (issue 26): each way of laying the ranks out x each precision policy x
each kind of training, and each layout with torch.compile, recomputation and a resume; for every
cell either "works" or the one line that refuses it before launch.

Nothing is decided here. A cell's verdict is the real checks' (DESIGN.md, "Everything allowed
composes"): its config is made and validated as `lmforge train` makes it (config/load.py's
`make_config`, which runs config/validate.py), then parallel/launch.py's `check_launch` is given
the environment torchrun would give rank 0 of the layout's ranks, with no process group and no
file (check_launch runs before either exists). A check that changes changes the table.

Which test trains each working cell is `COVERAGE` below; the table marks the rest "works,
untested" (the data-parallel dist tests cover the product pairwise: see docs/composition.md;
every pipeline cell is trained).

    python -m lmforge.parallel.matrix > docs/composition.md    regenerate the page
"""

import sys
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

    @property
    def overrides(self) -> list[str]:
        piped = [f"train.pipeline_stages={self.stages}", f"train.micro_batches={self.stages}"] if self.stages > 1 else []
        tensor = [f"parallel.tp={self.tp}"] if self.tp > 1 else []
        context = [f"parallel.cp={self.cp}", "train.sample_tokens=0"] if self.cp > 1 else []
        return [f"train.parallel={self.parallel}", *piped, *tensor, *context]

    @property
    def env(self) -> tuple[int, int, int] | None:
        """(RANK, WORLD_SIZE, LOCAL_RANK) of rank 0 under torchrun; None: no torchrun."""
        return None if self.ranks == 1 else (0, self.ranks, 0)


def layouts() -> list[Layout]:
    """One process, each strategy on 2 ranks, a 2-stage pipeline, and the pipeline with 2 replicas
    under each strategy (4 ranks): every strategy modes/parallel.py names, with and without stages;
    tensor parallelism on 2 ranks, and 2 of them as replicas under each strategy (4 ranks); context
    parallelism on 2 ranks, 2 of them as ddp replicas, and tp=2 x cp=2 (4 ranks each); tp=4 over
    the model's 2 KV heads (parallel/tp.py replicates each on 2 ranks); pipelines of tp=2 stages
    (4 ranks), their stages replicated under ddp or zero1 (8 ranks: pp x dp x tp)."""
    strategies = [name for name in PARALLEL_STRATEGIES if name != "none"]
    return ([Layout("one process", "none")] + [Layout(s, s, 1, 2) for s in strategies]
            + [Layout("pipeline", "none", STAGES, STAGES)]
            + [Layout(f"pipeline x {s}", s, STAGES, 2 * STAGES) for s in strategies]
            + [Layout("tp", "none", 1, 2, tp=2)] + [Layout(f"tp x {s}", s, 1, 4, tp=2) for s in strategies]
            + [Layout("pipeline x tp", "none", STAGES, 2 * STAGES, tp=2)]
            + [Layout(f"pipeline x tp x {s}", s, STAGES, 4 * STAGES, tp=2) for s in ("ddp", "zero1")]
            + [Layout("cp", "ddp", 1, 2, cp=2), Layout("cp x ddp", "ddp", 1, 4, cp=2),
               Layout("tp x cp", "ddp", 1, 4, tp=2, cp=2)]
            + [Layout("tp=4, KV heads replicated", "none", 1, 4, tp=4)])  # tiny's 2 KV heads, each on 2 ranks


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


# -- which test trains which cells ----------------------------------------------------------------

@dataclass(frozen=True)
class Covered:
    """`test` (tests/FILE.py::NAME) trains these cells to one process's numbers, bytes checked."""
    test: str
    layouts: tuple[str, ...]
    precisions: tuple[str, ...]
    kinds: tuple[str, ...] = ("pretraining",)
    extra: str | None = None  # a column of the second table


DP = ("ddp", "zero1", "zero2", "zero3", "fsdp")
MIXED = ("bf16-mixed", "fp16-mixed", "bf16-pure", "fp8")
DIST = "tests/test_composition_dist.py::"
PIPE = "tests/test_pipeline_compose_dist.py::"
CELLS = "tests/test_pipeline_cells_dist.py::"
TPC = "tests/test_tp_compose_dist.py::"
TPZ = "tests/test_tp_zero_dist.py::"
TP_SHARDED = ("tp x zero1", "tp x zero2", "tp x zero3", "tp x fsdp")
TPR = "tests/test_tp_resume_dist.py::"
CPC = "tests/test_cp_compose_dist.py::"
TPP = "tests/test_tp_pipeline_dist.py::"
PIPELINES = ("pipeline", "pipeline x ddp", "pipeline x zero1")
ALL_KINDS = tuple(KINDS)
COVERAGE = (
    # tests written before the matrix
    Covered("tests/test_parallel_engines.py::test_every_strategy_equals_one_process_on_the_global_batch",
            DP, ("fp32",)),
    Covered("tests/test_parallel_engines.py::test_bf16_mixed_uses_the_papers_layout_and_trains",
            ("ddp", "zero1", "zero3", "fsdp"), ("bf16-mixed",)),
    Covered("tests/test_engines_compose.py::test_lora_trains_under_every_strategy_as_in_one_process",
            DP, ("fp32",), ("LoRA",)),
    Covered("tests/test_pipeline.py::test_gpipe_and_1f1b_train_as_one_process_accumulating_the_micro_batches",
            ("pipeline",), ("fp32",)),
    Covered("tests/test_pipeline.py::test_bf16_mixed_pipeline_trains_as_one_process", ("pipeline",), ("bf16-mixed",)),
    Covered("tests/test_pipeline.py::test_four_stages_and_two_by_two_train_as_one_process",
            ("pipeline x ddp",), ("fp32",)),
    Covered("tests/test_pipeline.py::test_a_pipeline_with_full_recomputation_trains_as_one_process",
            ("pipeline",), ("fp32",), extra="recompute=full"),
    Covered("tests/test_finetune_dist.py::test_a_full_finetune_under_torchrun_equals_one_process",
            ("ddp", "zero1"), ("fp32",), ("full fine-tuning",)),
    Covered("tests/test_distributed_train.py::test_a_checkpoint_of_2_ranks_resumes_on_2_bit_for_bit_and_on_1_and_3"
            "_to_the_same_numbers", ("one process", "ddp"), ("fp32",), extra="checkpoint + resume"),
    Covered("tests/test_distributed_train.py::test_a_sharded_run_checkpoints_through_its_engine_and_resumes_on_"
            "another_strategy", ("zero3", "fsdp"), ("fp32",), extra="checkpoint + resume"),
    # one process, against eager / not recomputed (default suite)
    Covered("tests/test_compile.py::test_compiled_blocks_and_loss_match_eager_under_canonical_names",
            ("one process",), ("fp32",), extra="compiled"),
    *(Covered("tests/test_memory.py::test_recomputation_saves_what_the_formula_says_and_the_same_gradients",
              ("one process",), ("fp32",), extra=extra) for extra in EXTRAS if extra.startswith("recompute=")),
    # this matrix's own (tests/test_composition_dist.py runs exactly these cells, in one launch)
    Covered(DIST + "test_every_strategy_trains_in_every_precision_as_one_process", DP, MIXED),
    Covered(DIST + "test_every_kind_trains_as_one_process", DP, ("fp32",), ("full fine-tuning",)),
    # each precision with each kind once, on a different strategy each time (pairwise)
    *(Covered(DIST + "test_every_kind_trains_as_one_process", (DP[(i + shift) % len(DP)],), (precision,), (kind,))
      for i, precision in enumerate(MIXED) for shift, kind in ((0, "full fine-tuning"), (2, "LoRA"))),
    Covered(DIST + "test_compiled_and_recomputed_engines_train_as_one_process", DP, ("fp32",), extra="compiled"),
    *(Covered(DIST + "test_compiled_and_recomputed_engines_train_as_one_process", DP, ("fp32",), extra=extra)
      for extra in EXTRAS if extra.startswith("recompute=")),
    Covered(DIST + "test_every_strategys_state_loads_back_by_name", DP, ("fp32",), extra="checkpoint + resume"),
    # pipelines with LoRA and with ZeRO-1 over each stage's replicas
    Covered(PIPE + "test_lora_on_a_pipeline_trains_as_one_process_with_lora", ("pipeline",), ("fp32",), ("LoRA",)),
    Covered(PIPE + "test_zero1_over_each_stages_replicas_trains_as_ddp_replicas_bit_for_bit_and_as_one_process",
            ("pipeline x zero1",), ("fp32",)),
    Covered(PIPE + "test_zero1_over_each_stages_replicas_trains_as_ddp_replicas_bit_for_bit_and_as_one_process",
            ("pipeline x zero1", "pipeline x ddp"), ("fp32",), ("LoRA",)),
    # every pipeline layout in every precision and kind, compiled, recomputed and resumed
    # (tests/test_pipeline_cells_dist.py runs exactly these cells: one launch of 2 ranks, one of 4)
    Covered(CELLS + "test_every_pipeline_trains_in_every_precision_and_kind_as_one_process", PIPELINES, MIXED,
            ALL_KINDS),
    Covered(CELLS + "test_every_pipeline_trains_in_every_precision_and_kind_as_one_process", PIPELINES, ("fp32",),
            ("full fine-tuning",)),
    *(Covered(CELLS + "test_compiled_and_recomputed_pipelines_train_as_one_process", PIPELINES, ("fp32",),
              extra=extra) for extra in EXTRAS if extra != "checkpoint + resume"),
    Covered(CELLS + "test_every_pipelines_state_loads_back_by_name_and_steps_on_exactly", PIPELINES, ("fp32",),
            extra="checkpoint + resume"),
    Covered(CELLS + "test_a_pipeline_run_stopped_by_sigterm_resumes_bit_for_bit", ("pipeline x zero1",), ("fp32",),
            extra="checkpoint + resume"),
    # tensor parallelism (tests/test_tp_compose_dist.py: its LoRA cells train adapters on the
    # model's own initialisation; a base is loaded into the whole model before the split)
    Covered("tests/test_tp_dist.py::test_tp2_trains_as_one_process", ("tp",), ("fp32",)),
    Covered("tests/test_tp_dist.py::test_tp2_times_ddp2_trains_as_one_process", ("tp x ddp",), ("fp32",)),
    Covered("tests/test_tp_train_dist.py::test_tp2_trains_as_one_process_and_resumes_in_one_process", ("tp",),
            ("fp32",), extra="checkpoint + resume"),
    # a tp checkpoint holds whole tensors: it resumes at another degree (tests/test_tp_resume_dist.py)
    Covered(TPR + "test_tp2_times_ddp2_exports_and_generates_whole_and_resumes_in_one_process", ("tp x ddp",),
            ("fp32",), extra="checkpoint + resume"),
    Covered(TPR + "test_a_one_process_checkpoint_resumes_at_tp2_and_samples_with_a_split_kv_cache", ("tp",),
            ("fp32",), extra="checkpoint + resume"),
    Covered(TPC + "test_tp2_composes_and_trains_as_one_process", ("tp",), ("bf16-mixed", "bf16-pure")),
    Covered(TPC + "test_tp2_composes_and_trains_as_one_process", ("tp",), ("fp32", "bf16-mixed"), ("LoRA",)),
    *(Covered(TPC + "test_tp2_composes_and_trains_as_one_process", ("tp",), ("fp32",), extra=extra)
      for extra in EXTRAS if extra.startswith("recompute=")),
    Covered(TPC + "test_tp2_compiled_trains_as_one_process_compiled", ("tp",), ("fp32",), extra="compiled"),
    Covered(TPC + "test_tp2_times_ddp2_composes_and_trains_as_one_process", ("tp x ddp",), ("bf16-mixed",)),
    Covered(TPC + "test_tp2_times_ddp2_composes_and_trains_as_one_process", ("tp x ddp",), ("fp32",), ("LoRA",)),
    # one mesh, dp x tp: the replicas sharded (tests/test_tp_zero_dist.py, against the tp x ddp run)
    Covered(TPZ + "test_sharded_replicas_of_a_tp_model_train_as_ddp_replicas", TP_SHARDED, ("fp32",)),
    Covered(TPZ + "test_sharded_replicas_of_a_tp_model_train_as_ddp_replicas", ("tp x zero3", "tp x fsdp"), ("fp32",),
            ("LoRA",)),
    Covered(TPZ + "test_sharded_replicas_in_bf16_mixed_train_as_ddp_replicas_and_hold_the_fp32_masters_as_planned",
            ("tp x zero1", "tp x zero3", "tp x fsdp"), ("bf16-mixed",)),
    Covered(TPZ + "test_state_loads_back_into_a_fresh_engine_and_steps_on_exactly", TP_SHARDED, ("fp32",),
            extra="checkpoint + resume"),
    Covered(TPZ + "test_lmforge_train_tp2_zero2_on_4_ranks_resumes_exactly", ("tp x zero2",), ("fp32",),
            extra="checkpoint + resume"),
    # context parallelism (tests/test_cp_compose_dist.py: LoRA cells as tp's, on the model's own initialisation)
    Covered("tests/test_cp_train_dist.py::test_cp2_engine_trains_as_one_process", ("cp", "cp x ddp"), ("fp32",)),
    Covered("tests/test_cp_train_dist.py::test_lmforge_train_cp2_trains_checkpoints_and_resumes_as_one_process",
            ("cp",), ("fp32",), extra="checkpoint + resume"),
    Covered(CPC + "test_cp2_composes_and_trains_as_one_process", ("cp",), MIXED),
    Covered(CPC + "test_cp2_composes_and_trains_as_one_process", ("cp x ddp",), ("fp16-mixed",)),
    Covered(CPC + "test_cp2_composes_and_trains_as_one_process", ("cp", "cp x ddp"), ("fp32",), ("LoRA",)),
    *(Covered(CPC + "test_cp2_composes_and_trains_as_one_process", ("cp",), ("fp32",), extra=extra)
      for extra in EXTRAS if extra.startswith("recompute=")),
    Covered(CPC + "test_cp2_compiled_trains_as_one_process_compiled", ("cp",), ("fp32",), extra="compiled"),
    Covered(CPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp",), ("fp32", "bf16-mixed")),
    Covered(CPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp",), ("fp32",), ("LoRA",)),
    # fewer KV heads than ranks (tests/test_tp_replicated_kv_plan_dist.py: their bytes as planned, bf16-mixed too)
    Covered("tests/test_tp_replicated_kv_dist.py::test_tp4_with_2_kv_heads_trains_as_one_process",
            ("tp=4, KV heads replicated",), ("fp32",)),
    # pipelines of tensor-parallel stages (tests/test_tp_pipeline_dist.py, tests/test_tp_pipeline_train_dist.py)
    Covered(TPP + "test_two_tensor_parallel_stages_train_as_one_process", ("pipeline x tp",), ("fp32",)),
    Covered(TPP + "test_bf16_mixed_tensor_parallel_stages_train_as_one_process_to_16_bit_bounds", ("pipeline x tp",),
            ("bf16-mixed",)),
    Covered(TPP + "test_tensor_parallel_stages_compose_and_train_as_one_process", ("pipeline x tp",), ("fp32",),
            ("LoRA",)),
    Covered(TPP + "test_tensor_parallel_stages_compose_and_train_as_one_process", ("pipeline x tp",), ("fp32",),
            extra="recompute=full"),
    Covered(TPP + "test_pp2_x_dp2_x_tp2_trains_as_one_process_with_ddp_and_zero1_replicas",
            ("pipeline x tp x ddp", "pipeline x tp x zero1"), ("fp32",)),
    Covered("tests/test_tp_pipeline_train_dist.py::test_lmforge_train_pp2_x_tp2_trains_as_one_process_and_resumes_"
            "in_one_process", ("pipeline x tp",), ("fp32",), extra="checkpoint + resume"),
)


def tests_of(layout: str, precision: str, kind: str = "pretraining", extra: str | None = None) -> list[str]:
    return [c.test for c in COVERAGE if layout in c.layouts and precision in c.precisions and kind in c.kinds
            and c.extra == extra]


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
        "<!-- generated by `python -m lmforge.parallel.matrix > docs/composition.md`; tests/test_composition.py",
        "     fails when this file differs from what the checks say now -->",
        "",
        "Every way of laying out the ranks, in every precision policy, for every kind of training: each cell",
        "either trains (a dist test trains it a few steps to one process's numbers on the same global batch,",
        "with the bytes each rank holds equal to the plan's) or is refused before any process group or file",
        "exists, with the one line below. The verdicts are the real checks' (`lmforge/parallel/matrix.py`",
        "makes each cell's config with `make_config`, which validates it, and runs `check_launch` with the",
        "environment torchrun would give rank 0), on the `tiny` model, so the table changes when they do.",
        "",
        "`✓ tN`: works, trained by test tN; `✓ -`: passes the checks, trained by no test (the tests cover",
        "the product pairwise: each strategy with each precision, each kind with each precision and each",
        "strategy, not every triple); `ref`: one process, the reference the others are compared with;",
        "`✗ rN`: refused with line rN. pre: pretraining; full FT: every weight of a base trains, on",
        "examples whose prompts have no targets; LoRA: rank-4 adapters on a frozen base.",
        "",
        "Regenerate: `python -m lmforge.parallel.matrix > docs/composition.md`. Run the dist tests:",
        "`python -m pytest -m dist tests/test_composition_dist.py` (one torchrun launch of 2 ranks, 53 cells:",
        "4m08s on the 2 CPU cores shared with other work). Where this ran: the 2-core CPU VM, gloo; no GPU (fp8 simulated:",
        "precision/fp8.py)."]
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
        "Pipelines of tensor-parallel stages (2 stages x tp 2, and x 2 replicas on 8 ranks):",
        "tests/test_tp_pipeline_dist.py, tensor parallelism's bounds (docs/tensor-parallel.md); each rank's",
        "bytes equal its stage's tensors, but the plan's stage figures count the norm gains as split (0.2% under).",
        "",
        "Not in the table: `train.pipeline_engine=torch` with fp16-mixed is refused (it does not scale the",
        "loss); interleaved 1F1B compiled and in bf16-mixed, and the torch engine with ZeRO-1 replicas,",
        "LoRA and a full fine-tune are trained by tests/test_pipeline_cells_dist.py (as are interleaved",
        "fp32, recomputed and replicated by tests/test_pipeline_interleaved_dist.py)."]

if __name__ == "__main__":
    sys.stdout.write(page())
