"""The end of a run: the summary (summary.json, the table, loss.png, a sample) and the plan printed
at the start set beside what the session measured (train/measurements.py).
"""

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmforge.accounting.hardware import TIMED_DTYPE, device_name
from lmforge.accounting.plan.tables import print_comparison
from lmforge.common.errors import for_terminal, human_count
from lmforge.config import Config
from lmforge.generate.sampling import generate
from lmforge.runs.plots import plot_losses, run_title
from lmforge.runs.state import TARGET_REACHED
from lmforge.train.evaluate import task_rows
from lmforge.train.measurements import RunMeasurements

# train.sample_prompt="" starts the end-of-run sample with this many tokens of a validation document.
SAMPLE_PROMPT_TOKENS = 8


def write_summary(run: RunMeasurements, cfg: Config, plan: dict | None, data, model, run_dir: Path, console: Console,
                  is_main: bool, estimate, check_stop=lambda: None) -> dict:
    """The end of a session: summary.json, loss.png, sample.txt, the summary table and the `plan`
    set beside what was measured (written by rank 0, `is_main`; every rank calls it). `data` (its
    tokenizer and validation split) and `model` give the sample. `estimate(what, fn)` runs the
    comparison with the plan (None: the plan failed), whose failure is one warning line
    (measurements.estimate). `check_stop()`, called after each token of the sample (on every rank),
    raises to end the session on a stop request before anything is written."""
    summary = summary_of(run, data.meta, run_dir)
    plan = plan or {}
    summary["predicted_vs_measured"] = estimate("the predicted-vs-measured comparison", lambda: predicted_vs_measured(
        plan, run, summary["tokens_per_s"])) if plan else None
    if cfg.train.target_loss is not None:  # the step whose evaluation reached it, or None
        reached = run.state.history.get(TARGET_REACHED)
        summary["target_loss"], summary["target_reached_step"] = cfg.train.target_loss, reached and reached["step"]
    if "eval_tasks" in run.state.history:  # train.eval_tasks' scores at the last evaluation
        summary["eval_tasks"] = run.state.history["eval_tasks"]
    if "scaling" in plan:  # train.scaling_fit: the loss the fit predicted at the start
        summary["val_loss_predicted_by_fit"] = {k: plan["scaling"][k] for k in ("loss", "parameters", "tokens")}
    # the sample: on every rank (a sharded model needs all of them in each forward); a pipeline's
    # stages are not a model that generates: `lmforge generate` reads its checkpoint whole
    if cfg.train.sample_tokens and run.pipeline is None:
        end = data.tokenizer.token_to_id(cfg.data.end_token)
        summary["sample_prompt"] = cfg.train.sample_prompt or default_prompt(data, end)
        summary["sample"] = sample(model, data.tokenizer, summary["sample_prompt"], cfg.train.sample_tokens, end,
                                   on_token=lambda token: check_stop())
    if not is_main:  # rank 0 alone writes and prints
        return summary
    plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png", title=run_title(run_dir.name, cfg, run.parameters),
                unigram_entropy=data.meta["unigram_entropy_nats"], tokens_per_step=run.tokens_per_step)
    if "sample" in summary:
        (run_dir / "sample.txt").write_text(summary["sample"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(console, summary, run, cfg.train.fp32_attention)
    if summary["predicted_vs_measured"]:
        estimate("printing the comparison", lambda: print_comparison(console, summary["predicted_vs_measured"]))
    if "sample" in summary:
        console.rule("sample")
        console.print(for_terminal(summary["sample"]), markup=False, highlight=False)  # sample.txt keeps it raw
    return summary


def summary_of(run: RunMeasurements, meta: dict, run_dir: Path) -> dict:
    """summary.json's numbers (the prepared data's `meta` gives the corpus's)."""
    state, tokens_per_s = run.state, run.tokens_per_s
    val_split, val_loss = meta["splits"]["val"], state.history["val_loss"]
    lost = run.lost_updates
    summary = {
        "run_dir": str(run_dir),
        "device": device_name(run.device),
        "parameters": run.parameters,
        "steps": state.step,
        "tokens_trained": state.tokens_trained,
        "train_seconds_this_session": run.train_seconds,
        "compile_seconds": run.compile_seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": run.flops_per_token,
        "peak_flops_measured": run.peak_flops,
        "mfu": run.mfu(tokens_per_s),
        "data_wait_fraction": run.data_wait_seconds / run.train_seconds if run.train_seconds else 0.0,
        "precision": run.precision,
        "skipped_steps": state.skipped_steps,
        "lost_update_fraction": lost[0] / lost[1] if lost and lost[1] else None,
        "train_loss": state.history["train_loss"],
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_bits_per_byte": val_loss * val_split["tokens"] / val_split["bytes"] / math.log(2),
        "unigram_entropy_nats": meta["unigram_entropy_nats"],
    }
    if run.pipeline is not None:
        summary["pipeline"] = run.pipeline
    return summary


def print_summary(console: Console, summary: dict, run: RunMeasurements, fp32_attention: bool) -> None:
    """The summary table and a pipeline's bubble."""
    print_table(console, summary_rows(summary, run.peak_dtype, fp32_attention, run.loss_scale),
                title="lmforge train: summary")
    pipeline = run.pipeline
    if pipeline is not None and pipeline["bubble_measured"] is not None:
        v = pipeline.get("virtual_stages", 1)
        console.print(f"pipeline ({pipeline['schedule']}, p={pipeline['stages']}, m={pipeline['micro_batches']}"
                      f"{f', v={v}' if v > 1 else ''}): bubble measured {pipeline['bubble_measured']:.1%} of the step, "
                      f"{'(p-1)/(vm+p-1)' if v > 1 else '(p-1)/(m+p-1)'} = "
                      f"{pipeline['bubble_formula']:.1%}; timeline of step {pipeline['timeline_step']} in "
                      f"{Path(summary['run_dir']) / 'pipeline.png'} and pipeline_trace.json", soft_wrap=True)


def summary_rows(summary: dict, peak_dtype: str, fp32_attention: bool, loss_scale: float | None = None
                 ) -> list[tuple[str, str]]:
    """The summary table's rows, from summary.json's fields (`lmforge report` writes the same rows):
    `peak_dtype` the matmul dtype whose peak was timed, `loss_scale` fp16-mixed's after the last step."""
    compiled = summary["compile_seconds"] is not None
    flops = summary["flops_per_token"]
    return [
        ("parameters", f"{summary['parameters'] / 1e6:.2f} M"),
        ("steps", f"{summary['steps']:,} ({summary['tokens_trained']:,} tokens)"),
        ("training time (this session)", f"{summary['train_seconds_this_session']:.0f} s"),
        *([("compile (first step, included)", f"{summary['compile_seconds']:.1f} s")] if compiled else []),
        ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s" + (", after the compile" if compiled else "")),
        ("training FLOPs", f"{human_count(flops * summary['tokens_trained'])} ({human_count(flops)} per token)"),
        ("MFU", f"{summary['mfu']:.1%}"),
        ("peak, measured", f"{summary['peak_flops_measured'] / 1e9:,.0f} GFLOP/s ({timed_dtype(peak_dtype)} matmul)"),
        ("device", summary["device"]),
        ("precision", summary["precision"] + (", attention in fp32" if fp32_attention else "")),
        ("skipped steps (non-finite)", f"{summary['skipped_steps']:,}" + (
            f", loss scale now {loss_scale:g}" if loss_scale is not None else "")),
        *([("updates rounded to zero (bf16 weights)", f"{summary['lost_update_fraction']:.2%}")]
          if summary["lost_update_fraction"] is not None else []),
        ("data loader waiting", f"{summary['data_wait_fraction']:.2%} of step time"),
        ("train loss", f"{summary['train_loss']:.4f} nats/token"),
        ("validation loss", f"{summary['val_loss']:.4f} nats/token"),
        *([target_row(summary)] if "target_loss" in summary else []),
        *([scaling_row(summary)] if "val_loss_predicted_by_fit" in summary else []),
        ("validation perplexity", f"{summary['val_perplexity']:.1f} ({summary['val_bits_per_byte']:.3f} bits/byte)"),
        ("unigram entropy of the corpus", f"{summary['unigram_entropy_nats']:.4f} nats/token"),
        *(task_rows(summary["eval_tasks"]) if "eval_tasks" in summary else []),
        ("run folder", summary["run_dir"]),
    ]


def scaling_row(summary: dict) -> tuple[str, str]:
    """The validation loss the scaling fit predicted (train.scaling_fit), and how far the run landed from it."""
    p = summary["val_loss_predicted_by_fit"]
    error = (p["loss"] - summary["val_loss"]) / summary["val_loss"]
    tokens = "" if p["tokens"] == summary["tokens_trained"] else f" at train.max_steps' {p['tokens']:,} tokens"
    return "validation loss, the scaling fit's", f"{p['loss']:.4f} nats/token{tokens} ({error:+.1%} of measured)"


def target_row(summary: dict) -> tuple[str, str]:
    """train.target_loss: the step whose validation loss reached it, or that none did."""
    step = summary["target_reached_step"]
    return (f"train.target_loss {summary['target_loss']:g}",
            "not reached" if step is None else f"target reached at step {step:,}")


def print_table(console: Console, rows: list[tuple[str, str]], title: str) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def timed_dtype(peak_dtype: str) -> str:
    """The dtype whose matmuls were timed for the peak (fp8's peak is bf16's)."""
    timed = str(TIMED_DTYPE[peak_dtype]).removeprefix("torch.")
    return timed if timed == peak_dtype else f"{timed}, standing in for {peak_dtype}"


def predicted_vs_measured(plan: dict, run: RunMeasurements, tokens_per_s: float) -> dict:
    """The plan printed at the start beside what this session measured. A pipeline's plan gets its
    memory rows per stage ("stage 1 parameters_bytes", ...) instead of one device's, measured from
    the pipeline report's `measured_by_stage` (one dict per stage, from replica 0's rank of it;
    "parameters", "gradients", "optimizer_states", "activations": one micro-batch's forward,
    "activations_in_flight": the peak alive at once)."""
    measured = run.first_step
    breakdown = plan["memory"]["breakdown_bytes"]
    activations = plan["memory"]["activation_breakdown_bytes"]
    stages = plan["pipeline"]["stages_detail"] if "pipeline" in plan else None
    rows = {}
    # the utilisations at the step time the roofline predicted (accounting/roofline/__init__.py); without it,
    # the bound: 100%, or less for a pipeline (its bubble and unequal stages)
    predicted_tokens_per_s = None
    if "roofline" in plan and tokens_per_s:
        rows["step_seconds"] = (plan["roofline"]["seconds_per_step"], run.tokens_per_step / tokens_per_s)
        predicted_tokens_per_s = run.tokens_per_step / plan["roofline"]["seconds_per_step"]
    bound = plan["pipeline"]["best_mfu"] if stages else 1.0
    rows["mfu"] = (run.mfu(predicted_tokens_per_s) if predicted_tokens_per_s else bound, run.mfu(tokens_per_s))
    if run.hardware_flops_per_token is not None:
        rows["hfu"] = (run.hfu(predicted_tokens_per_s) if predicted_tokens_per_s else 1.0, run.hfu(tokens_per_s))
    if stages:
        by_stage = run.pipeline["measured_by_stage"] if run.pipeline is not None else [None] * len(stages)
        for stage, got in zip(stages, by_stage):
            got = got or {}
            for key in ("parameters", "gradients", "optimizer_states"):
                rows[f"stage {stage['stage']} {key}_bytes"] = (stage["breakdown_bytes"][key], got.get(key))
            rows[f"stage {stage['stage']} activations_bytes"] = (stage["activations_per_micro_batch_bytes"],
                                                                 got.get("activations"))
            rows[f"stage {stage['stage']} activations_in_flight_bytes"] = (stage["activations_in_flight_bytes"],
                                                                           got.get("activations_in_flight"))
    else:
        for key in ("parameters", "gradients", "optimizer_states"):
            rows[f"{key}_bytes"] = (breakdown[key], measured.get(key))
        # what one micro-batch saves for backward: the layers, embedding, head and the weight casts
        rows["activations_bytes"] = (sum(activations.values()) - activations.get("recomputed_layer", 0)
                                     + breakdown["weight_copies"], measured.get("activations"))
    # counted by the engine's collectives; None where they are not its own (FSDP2's): "not measured"
    comm, steps = plan["communication"], max(run.state.step - run.start_step, 1)
    if run.sent_bytes is not None or comm["sent_bytes"]:
        rows["sent_bytes_per_step"] = (comm["sent_bytes"],
                                       run.sent_bytes / steps if run.sent_bytes is not None else None)
    for group, sent, part in (("tp", run.tp_sent_bytes, "tensor_parallel"),
                              ("cp", run.cp_sent_bytes, "context_parallel")):
        if sent is not None and part in comm:
            rows[f"{group}_sent_bytes_per_step"] = (comm[part]["sent_bytes"], sent / steps)
    if "peak_allocated" in measured:  # rank 0's: in a pipeline, stage 0's
        rows["peak_memory_bytes"] = (stages[0]["total_bytes"] if stages else plan["memory"]["per_device_bytes"],
                                     measured["peak_allocated"])
    return {key: {"predicted": p, "measured": m} for key, (p, m) in rows.items()}


def default_prompt(data, end: int) -> str:
    """The start of the first validation document (before the `end` token): a sample prompt in the
    corpus's own language."""
    if getattr(data, "default_prompt", ""):  # fine-tuning data says its own (train/finetune.py)
        return data.default_prompt
    start = data.val[:SAMPLE_PROMPT_TOKENS].tolist()
    return data.tokenizer.decode(start[:start.index(end)] if end in start else start)


def sample(model, tokenizer, prompt: str, max_new_tokens: int, end: int, seed: int = 0, on_token=None) -> str:
    """`prompt` and its continuation, until the `end` token (`on_token`: generate's)."""
    ids = generate(model, tokenizer.encode(prompt).ids or [end], max_new_tokens, temperature=0.8,
                   top_p=0.95, stop_token=end, seed=seed, on_token=on_token)
    return prompt + tokenizer.decode(ids)
