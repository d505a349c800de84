"""Which dist test trains which cells of the composition matrix (tests/composition_matrix.py): a
cell no entry names is "works, untested" on docs/composition.md. tests/test_composition.py checks
that every test named here exists and that every cell it covers passes the checks."""

from dataclasses import dataclass

from lmforge.modes import DATA_PARALLEL, POLICIES, RECOMPUTE_MODES, SHARDING

PRECISIONS = tuple(POLICIES)
ALL_KINDS = ("pretraining", "full fine-tuning", "LoRA")  # the matrix's KINDS
RECOMPUTED = tuple(f"recompute={mode}" for mode in RECOMPUTE_MODES if mode != "none")  # columns of the second table


@dataclass(frozen=True)
class Covered:
    """`test` (tests/FILE.py::NAME) trains these cells to one process's numbers, bytes checked."""
    test: str
    layouts: tuple[str, ...]
    precisions: tuple[str, ...]
    kinds: tuple[str, ...] = ("pretraining",)
    extra: str | None = None  # a column of the second table


DP = DATA_PARALLEL
MIXED = tuple(p for p in PRECISIONS if p != "fp32")
DIST = "tests/test_composition_dist.py::"
PIPE = "tests/test_pipeline_compose_dist.py::"
CELLS = "tests/test_pipeline_cells_dist.py::"
TPC = "tests/test_tp_compose_dist.py::"
TPZ = "tests/test_tp_zero_dist.py::"
TP_SHARDED = tuple(f"tp x {s}" for s in SHARDING)
TPR = "tests/test_tp_resume_dist.py::"
CPC = "tests/test_cp_compose_dist.py::"
TPP = "tests/test_tp_pipeline_dist.py::"
SPC = "tests/test_sp_cp_dist.py::"
CPZ = "tests/test_cp_zero_dist.py::"
CP_SHARDED = tuple(f"cp x {s}" for s in SHARDING)
TP_CP_SHARDED = tuple(f"tp x cp x {s}" for s in SHARDING)
TPF = "tests/test_tp_precision_dist.py::"
PIPELINES = ("pipeline", "pipeline x ddp", "pipeline x zero1")
TPCELLS = "tests/test_tp_cells_dist.py::"
TP_ROWS = ("tp", "tp x ddp", *TP_SHARDED, "tp x cp", "pipeline x tp", "tp=4, KV heads replicated")
FINETUNES = ("full fine-tuning", "LoRA")
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
              ("one process",), ("fp32",), extra=extra) for extra in RECOMPUTED),
    # this matrix's own (tests/test_composition_dist.py runs exactly these cells, in one launch)
    Covered(DIST + "test_every_strategy_trains_in_every_precision_as_one_process", DP, MIXED),
    Covered(DIST + "test_every_kind_trains_as_one_process", DP, ("fp32",), ("full fine-tuning",)),
    # each precision with each kind once, on a different strategy each time (pairwise)
    *(Covered(DIST + "test_every_kind_trains_as_one_process", (DP[(i + shift) % len(DP)],), (precision,), (kind,))
      for i, precision in enumerate(MIXED) for shift, kind in ((0, "full fine-tuning"), (2, "LoRA"))),
    Covered(DIST + "test_compiled_and_recomputed_engines_train_as_one_process", DP, ("fp32",), extra="compiled"),
    *(Covered(DIST + "test_compiled_and_recomputed_engines_train_as_one_process", DP, ("fp32",), extra=extra)
      for extra in RECOMPUTED),
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
              extra=extra) for extra in ("compiled", *RECOMPUTED)),
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
      for extra in RECOMPUTED),
    Covered(TPC + "test_tp2_compiled_trains_as_one_process_compiled", ("tp",), ("fp32",), extra="compiled"),
    Covered(TPC + "test_tp2_times_ddp2_composes_and_trains_as_one_process", ("tp x ddp",), ("bf16-mixed",)),
    Covered(TPC + "test_tp2_times_ddp2_composes_and_trains_as_one_process", ("tp x ddp",), ("fp32",), ("LoRA",)),
    # fp16-mixed (found-inf agreed over tp and dp) and fp8 (split fp8 linears): tests/test_tp_precision_dist.py
    Covered(TPF + "test_tp2_trains_in_fp16_mixed_and_fp8_as_one_process", ("tp",), ("fp16-mixed", "fp8"),
            ("pretraining", "LoRA")),
    Covered(TPF + "test_pipelines_of_tp_stages_train_in_fp16_mixed_and_fp8_as_one_process", ("pipeline x tp",),
            ("fp16-mixed", "fp8")),
    Covered(TPF + "test_tp2_times_every_data_parallel_strategy_and_cp_trains_in_fp16_mixed_and_fp8_as_one_process",
            ("tp x ddp", *TP_SHARDED, "tp x cp"), ("fp16-mixed", "fp8")),
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
      for extra in RECOMPUTED),
    Covered(CPC + "test_cp2_compiled_trains_as_one_process_compiled", ("cp",), ("fp32",), extra="compiled"),
    Covered(CPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp",), ("fp32", "bf16-mixed")),
    Covered(CPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp",), ("fp32",), ("LoRA",)),
    # the sharding strategies over the dp x cp ranks (tests/test_cp_zero_dist.py, against cp x ddp and one process)
    Covered(CPZ + "test_sharded_cp_trains_as_cp_ddp_and_as_one_process", CP_SHARDED + TP_CP_SHARDED, ("fp32",)),
    Covered(CPZ + "test_state_loads_back_by_name_and_steps_on_exactly", CP_SHARDED + TP_CP_SHARDED, ("fp32",),
            extra="checkpoint + resume"),
    Covered(CPZ + "test_lmforge_train_cp2_sharded_stops_resumes_and_equals_the_straight_run", ("cp x zero2",),
            ("fp32",), extra="checkpoint + resume"),
    # fewer KV heads than ranks (tests/test_tp_replicated_kv_plan_dist.py: their bytes as planned, bf16-mixed too)
    Covered("tests/test_tp_replicated_kv_dist.py::test_tp4_with_2_kv_heads_trains_as_one_process",
            ("tp=4, KV heads replicated",), ("fp32",)),
    # sequence parallelism inside cp, one KV head under cp and FSDP2 (tests/test_sp_cp_dist.py: one 4-rank launch)
    Covered(SPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp, sequence parallel", "tp x cp, 1 KV head"),
            ("fp32",)),
    Covered(SPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp, sequence parallel",), ("bf16-mixed",)),
    Covered(SPC + "test_tp2_times_cp2_trains_as_one_process", ("tp x cp, sequence parallel",), ("fp32",), ("LoRA",)),
    Covered(SPC + "test_fsdp2_over_a_replicated_kv_head_trains_as_one_process_and_holds_the_plan",
            ("tp x fsdp, 1 KV head",), ("fp32",)),
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
    # the tp and cp rows' cells the tests above leave (tests/test_tp_cells_dist.py runs exactly
    # these: one launch of 2 ranks, one of 4)
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", TP_ROWS, ("bf16-mixed", "bf16-pure"),
            FINETUNES),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", TP_ROWS, ("bf16-pure",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", TP_ROWS, ("fp32",), ("full fine-tuning",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process",
            ("tp x zero1", "tp x zero2", "tp=4, KV heads replicated"), ("fp32",), ("LoRA",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", ("tp x zero2", "tp=4, KV heads replicated"),
            ("bf16-mixed",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", ("cp", "cp x ddp"), PRECISIONS,
            ("full fine-tuning",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", ("cp", "cp x ddp"), MIXED, ("LoRA",)),
    Covered(TPCELLS + "test_every_tp_and_cp_cell_trains_as_one_process", ("cp x ddp",),
            ("bf16-mixed", "bf16-pure", "fp8")),
    *(Covered(TPCELLS + "test_recomputed_tp_and_cp_cells_train_as_one_process",
              ("tp x ddp", *TP_SHARDED, "tp x cp", "cp x ddp", "tp=4, KV heads replicated"), ("fp32",), extra=extra)
      for extra in RECOMPUTED),
    Covered(TPCELLS + "test_recomputed_tp_and_cp_cells_train_as_one_process", ("pipeline x tp",),
            ("fp32",), extra="recompute=selective"),
    Covered(TPCELLS + "test_compiled_tp_cells_train_as_one_process_compiled", ("tp x zero3",), ("fp32",),
            extra="compiled"),
    Covered(TPCELLS + "test_every_tp_and_cp_cells_state_loads_back_by_name_and_steps_on_exactly",
            ("cp x ddp", "tp x cp", "tp=4, KV heads replicated"), ("fp32",), extra="checkpoint + resume"),
    Covered("tests/test_mesh_config_dist.py::test_hybrid_sharding_trains_as_one_process_holding_the_plans_bytes",
            ("hsdp: dp_replicate 2 x dp_shard 2",), ("fp32",)),
    Covered("tests/test_mesh_config_dist.py::test_the_issues_command_trains_checkpoints_and_resumes_as_one_process",
            ("tp x fsdp",), ("fp32",), extra="checkpoint + resume"),
)


def tests_of(layout: str, precision: str, kind: str = "pretraining", extra: str | None = None) -> list[str]:
    return [c.test for c in COVERAGE if layout in c.layouts and precision in c.precisions and kind in c.kinds
            and c.extra == extra]
