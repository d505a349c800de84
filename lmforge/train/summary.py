"""The end of a run: the summary (summary.json, the table, loss.png, a sample) and the plan printed
at the start set beside what the session measured.

`FirstStepMeasurement` takes those measurements in the first optimizer step of a session through
hooks (a forward pre/post hook on the model for the first micro-batch, a step post-hook on the
optimizer), so the training loop itself holds no measuring code; each hook removes itself once it
has run.
"""

import json
import math

import torch

from lmforge.accounting.hardware import TIMED_DTYPE, device_name
from lmforge.generate.sampling import generate
from lmforge.accounting.measure import measure_saved_bytes
from lmforge.accounting.plan.predicted_vs_measured import print_comparison
from lmforge.runs.plots import plot_losses, run_title
from lmforge.train.report import print_table

# train.sample_prompt="" starts the end-of-run sample with this many tokens of a validation document.
SAMPLE_PROMPT_TOKENS = 8


class FirstStepMeasurement:
    """`bytes`: activations saved for backward by the first micro-batch's forward, this rank's
    parameter, gradient and optimizer-state bytes after the first applied step (as the data-parallel
    engine holds them: shards, flat buffers), and on CUDA the peak allocated."""

    def __init__(self, engine, device: torch.device):
        self.engine, self.model, self.optimizer, self.device = engine, engine.model, engine.optimizer, device
        model, optimizer = self.model, self.optimizer
        self.bytes: dict = {}
        self._saving = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._hooks = {"step": optimizer.register_step_post_hook(self._after_step)}
        if not engine.measures_activations:  # a pipeline stage measures its micro-batches itself
            self._hooks.update(forward_pre=model.register_forward_pre_hook(self._start_forward),
                               forward=model.register_forward_hook(self._end_forward))

    def _start_forward(self, module, args):
        if torch.is_grad_enabled():  # a training forward (evaluation runs under no_grad)
            self._saving = measure_saved_bytes(self.model.parameters())
            self._saved = self._saving.__enter__()

    def _end_forward(self, module, args, output):
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self.bytes["activations"] = self._saved.activations
            self._saving = None
            for name in ("forward_pre", "forward"):
                self._hooks.pop(name).remove()

    def _after_step(self, optimizer, args, kwargs):
        self.bytes.update(self.engine.state_bytes())
        if self.device.type == "cuda":
            self.bytes["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        self._hooks.pop("step").remove()

    def close(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


def write_summary(trainer, start_step: int, train_seconds: float) -> dict:
    """The end of a session: summary.json, loss.png, sample.txt, the summary table and the plan set
    beside what was measured (written by rank 0; every rank calls it)."""
    cfg = trainer.cfg
    compile_seconds = getattr(trainer, "compile_seconds", None)
    steps = trainer.step - start_step - (1 if compile_seconds is not None else 0)  # the steps train_seconds timed
    tokens_per_s = steps * trainer.tokens_per_step / train_seconds if train_seconds else 0.0
    meta = trainer.data.meta
    val_split = meta["splits"]["val"]
    val_loss = trainer.history["val_loss"]
    summary = {
        "run_dir": str(trainer.run_dir),
        "device": device_name(trainer.device),
        "parameters": trainer.parameters,
        "steps": trainer.step,
        "tokens_trained": trainer.step * trainer.tokens_per_step,
        "train_seconds_this_session": train_seconds,
        "compile_seconds": compile_seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": trainer.flops_per_token,
        "peak_flops_measured": trainer.peak_flops,
        "mfu": tokens_per_s * trainer.flops_per_token / trainer.world_peak_flops,
        "data_wait_fraction": trainer.loader.wait_seconds / train_seconds if train_seconds else 0.0,
        "precision": trainer.policy.name,
        "skipped_steps": trainer.skipped_steps,
        "lost_update_fraction": (trainer.lost_updates_total[0] / trainer.lost_updates_total[1]
                                 if trainer.lost_updates_total[1] else None),
        "train_loss": trainer.history["train_loss"],
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_bits_per_byte": val_loss * val_split["tokens"] / val_split["bytes"] / math.log(2),
        "unigram_entropy_nats": meta["unigram_entropy_nats"],
    }
    pipeline = getattr(trainer, "pipeline", None)  # train/pipeline_report.py, on a pipeline run
    if pipeline is not None:
        summary["pipeline"] = pipeline
        trainer.measured_by_stage = pipeline["measured_by_stage"]
    summary["predicted_vs_measured"] = comparison = predicted_vs_measured(trainer, tokens_per_s)
    # the sample: on every rank (a sharded model needs all of them in each forward); a pipeline's
    # stages are not a model that generates: `lmforge generate` reads its checkpoint whole
    if cfg.train.sample_tokens and pipeline is None:
        summary["sample_prompt"] = cfg.train.sample_prompt or default_prompt(trainer)
        summary["sample"] = sample(trainer, summary["sample_prompt"], cfg.train.sample_tokens)
    if not trainer.world.is_main:  # rank 0 alone writes and prints
        return summary
    plot_losses(trainer.run_dir / "metrics.jsonl", trainer.run_dir / "loss.png",
                title=run_title(trainer.run_dir.name, cfg, summary["parameters"]),
                unigram_entropy=meta["unigram_entropy_nats"], tokens_per_step=trainer.tokens_per_step)
    if "sample" in summary:
        (trainer.run_dir / "sample.txt").write_text(summary["sample"])
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(trainer.console, [
        ("parameters", f"{summary['parameters'] / 1e6:.2f} M"),
        ("steps", f"{trainer.step:,} ({summary['tokens_trained']:,} tokens)"),
        ("training time (this session)", f"{train_seconds:.0f} s"),
        *([("compile (first step, included)", f"{compile_seconds:.1f} s")] if compile_seconds is not None else []),
        ("throughput", f"{tokens_per_s:,.0f} tokens/s" + (", after the compile" if compile_seconds is not None else "")),
        ("MFU", f"{summary['mfu']:.1%}"),
        ("peak, measured", f"{trainer.peak_flops / 1e9:,.0f} GFLOP/s ({timed_dtype(trainer.peak_dtype)} matmul)"),
        ("device", summary["device"]),
        ("precision", trainer.policy.name + (", attention in fp32" if cfg.train.fp32_attention else "")),
        ("skipped steps (non-finite)", f"{trainer.skipped_steps:,}" + (
            f", loss scale now {trainer.scaler.scale_value:g}" if trainer.scaler.enabled else "")),
        *([("updates rounded to zero (bf16 weights)", f"{summary['lost_update_fraction']:.2%}")]
          if summary["lost_update_fraction"] is not None else []),
        ("data loader waiting", f"{summary['data_wait_fraction']:.2%} of step time"),
        ("train loss", f"{summary['train_loss']:.4f} nats/token"),
        ("validation loss", f"{val_loss:.4f} nats/token"),
        ("validation perplexity", f"{summary['val_perplexity']:.1f} ({summary['val_bits_per_byte']:.3f} bits/byte)"),
        ("unigram entropy of the corpus", f"{meta['unigram_entropy_nats']:.4f} nats/token"),
        ("run folder", str(trainer.run_dir)),
    ], title="lmforge train: summary")
    print_comparison(trainer.console, comparison)
    if pipeline is not None and pipeline["bubble_measured"] is not None:
        trainer.console.print(f"pipeline ({pipeline['schedule']}, p={pipeline['stages']}, m={pipeline['micro_batches']}): "
                              f"bubble measured {pipeline['bubble_measured']:.1%} of the step, (p-1)/(m+p-1) = "
                              f"{pipeline['bubble_formula']:.1%}; timeline of step {pipeline['timeline_step']} in "
                              f"{trainer.run_dir / 'pipeline.png'} and pipeline_trace.json", soft_wrap=True)
    if "sample" in summary:
        trainer.console.rule("sample")
        trainer.console.print(summary["sample"], markup=False, highlight=False)
    return summary


def timed_dtype(peak_dtype: str) -> str:
    """The dtype whose matmuls were timed for the peak (fp8's peak is bf16's)."""
    timed = str(TIMED_DTYPE[peak_dtype]).removeprefix("torch.")
    return timed if timed == peak_dtype else f"{timed}, standing in for {peak_dtype}"


def predicted_vs_measured(trainer, tokens_per_s: float) -> dict:
    """The plan printed at the start beside what this session measured. A pipeline's plan gets its
    memory rows per stage ("stage 1 parameters_bytes", ...) instead of one device's, measured from
    `trainer.measured_by_stage` (one dict per stage, from replica 0's rank of it; "parameters",
    "gradients", "optimizer_states", "activations": one micro-batch's forward, "activations_in_flight":
    the peak alive at once)."""
    plan, measured = trainer.plan, trainer.measured.bytes
    breakdown = plan["memory"]["breakdown_bytes"]
    activations = plan["memory"]["activation_breakdown_bytes"]
    stages = plan["pipeline"]["stages_detail"] if "pipeline" in plan else None
    rows = {
        "tokens_per_s": (plan["time"]["tokens_per_second"], tokens_per_s),
        # a pipeline's bubble and unequal stages leave less than 100% at best
        "mfu": (plan["pipeline"]["best_mfu"] if stages else 1.0,
                tokens_per_s * trainer.flops_per_token / trainer.world_peak_flops),
    }
    if trainer.cfg.train.recompute != "none":
        rows["hfu"] = (1.0, tokens_per_s * trainer.hardware_flops_per_token / trainer.world_peak_flops)
    if stages:
        by_stage = getattr(trainer, "measured_by_stage", None) or [None] * len(stages)
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
    if trainer.engine.comm is not None:  # counted by the engine's collectives (fsdp's own are not seen)
        steps = max(trainer.step - trainer.session_start_step, 1)
        rows["sent_bytes_per_step"] = (plan["communication"]["sent_bytes"], trainer.engine.comm.sent_bytes() / steps)
    if "peak_allocated" in measured:  # rank 0's: in a pipeline, stage 0's
        rows["peak_memory_bytes"] = (stages[0]["total_bytes"] if stages else plan["memory"]["per_device_bytes"],
                                     measured["peak_allocated"])
    return {key: {"predicted": p, "measured": m} for key, (p, m) in rows.items()}


def default_prompt(trainer) -> str:
    """The start of the first validation document: a sample prompt in the corpus's own language."""
    if getattr(trainer.data, "default_prompt", ""):  # fine-tuning data says its own (train/finetune.py)
        return trainer.data.default_prompt
    tokenizer = trainer.data.tokenizer
    end = tokenizer.token_to_id(trainer.cfg.data.end_token)
    start = trainer.data.val[:SAMPLE_PROMPT_TOKENS].tolist()
    return tokenizer.decode(start[:start.index(end)] if end in start else start)

def sample(trainer, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    """`prompt` and its continuation."""
    tokenizer = trainer.data.tokenizer
    end = tokenizer.token_to_id(trainer.cfg.data.end_token)
    ids = generate(trainer.model, tokenizer.encode(prompt).ids or [end], max_new_tokens, temperature=0.8,
                   top_p=0.95, stop_token=end, seed=seed)
    return prompt + tokenizer.decode(ids)
