"""The end of a pipeline run: each stage's timeline of the last step and its measurements, gathered
on rank 0 and written into the run folder beside the summary.

    pipeline.png          one row per stage: forwards and backwards per micro-batch, the idle time blank
    pipeline_trace.json   the same events for chrome://tracing or ui.perfetto.dev
    summary.json          "pipeline": the measured bubble beside (p-1)/(m+p-1), per stage

`measured_by_stage` (replica 0's rank of each stage, tensor rank 0 of it): the bytes that stage holds (parameters,
gradients, optimizer states), the activations one micro-batch's forward saved, and the most saved
at once during the first step ("activations_in_flight"), for the predicted-vs-measured table.
"""

from pathlib import Path

import torch.distributed as dist

from lmforge.accounting.pipeline import bubble_fraction, virtual_split
from lmforge.config import Config
from lmforge.parallel.pipeline.timeline import measured_bubble, plot_timeline, write_chrome_trace


def pipeline_report(engine, events: list[dict], cfg: Config, first_step_bytes: dict, step: int, run_dir: Path,
                    is_main: bool) -> dict:
    """Gather every rank's timeline `events` (of `step`, the last) and its measurements (those of
    the session's first step, `first_step_bytes`, and the pipeline engine's); rank 0 (`is_main`)
    writes the files into `run_dir`. Every rank calls it."""
    t, layout = cfg.train, engine.layout
    mine = {"stage": layout.stage, "replica": layout.replica, "tp_rank": layout.tp_rank, "events": events,
            "bytes": {**first_step_bytes, "activations": engine.in_flight.get("one_micro_batch_bytes"),
                      "activations_in_flight": engine.in_flight.get("activation_bytes"),
                      "micro_batches_in_flight": engine.in_flight["micro_batches"]}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # one rank per stage: replica 0's, its tensor rank 0 with tp stages (the others hold as much)
    first_pipeline = sorted((r for r in everyone if r["replica"] == 0 and r["tp_rank"] == 0), key=lambda r: r["stage"])
    events_by_stage = [r["events"] for r in first_pipeline]
    # torch.distributed.pipelining's schedule (train.pipeline_engine=torch) runs without our timeline
    timed = all(events_by_stage)
    measured = measured_bubble(events_by_stage) if timed else \
        {"bubble": None, "idle_fraction_per_stage": None, "step_seconds": None}
    formula = bubble_fraction(layout.stages, t.micro_batches, layout.chunks)
    report = {"schedule": t.schedule, "engine": t.pipeline_engine, "stages": layout.stages,
              "replicas": layout.replicas, "micro_batches": t.micro_batches, "virtual_stages": layout.chunks,
              # layers per virtual stage: per stage with one chunk per rank
              "split": virtual_split(cfg.model, layout.stages, layout.chunks, t.pipeline_split, cfg.seq_len),
              "bubble_formula": formula, "bubble_measured": measured["bubble"],
              "idle_fraction_per_stage": measured["idle_fraction_per_stage"],
              "step_seconds": measured["step_seconds"], "timeline_step": step,
              "measured_by_stage": [r["bytes"] for r in first_pipeline]}
    if is_main and timed:
        title = (f"{t.schedule} pipeline: p={layout.stages} stages, m={t.micro_batches} micro-batches "
                 f"(step {step}, replica 0)")
        if layout.chunks > 1:
            title += f", v={layout.chunks} chunks per rank"
        plot_timeline(events_by_stage, run_dir / "pipeline.png", title, formula, measured,
                      "(p-1)/(vm+p-1)" if layout.chunks > 1 else "(p-1)/(m+p-1)")
        write_chrome_trace(events_by_stage, run_dir / "pipeline_trace.json",
                           {key: report[key] for key in ("schedule", "stages", "micro_batches", "bubble_formula",
                                                         "bubble_measured")})
    return report
