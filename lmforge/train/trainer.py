"""The training loop: data -> model -> AdamW, with evaluation, checkpoints, logs and a summary.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by grad_accum so that the summed gradient equals the gradient of the
mean loss over the whole batch. Then: clip the global gradient norm, set the scheduled learning
rate, AdamW step. Cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.
"""

import json
import math
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from tqdm import tqdm

from lmforge.accounting.flops import hardware_flops_per_token, training_flops_per_token
from lmforge.accounting.hardware import TIMED_DTYPE, device_name, this_device
from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.accounting.plan import Setup, make_plan, matmul_dtype
from lmforge.config import Config, config_warnings, load_config, save_config
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.data.prepare import PreparedData, prepare_data
from lmforge.data.tokenizer import END_OF_TEXT
from lmforge.errors import LmforgeError
from lmforge.generate.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.optim.clip import clip_grad_norm
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.planning import print_comparison, print_plan
from lmforge.precision import LossScaler, autocast, device_notes, get_policy, prepare_model
from lmforge.precision.policy import fp8_scale_state, load_fp8_scale_state
from lmforge.train import checkpoint as ckpt
from lmforge.train.host_memory import retain_freed_memory
from lmforge.train.recompute import apply_recompute
from lmforge.train.report import MetricsLog, plot_losses, print_table
from lmforge.warnings import warn

# Under fp16-mixed a step with inf/NaN gradients is skipped and the loss scale halved: normal at
# the start of a run and now and then later. This many skips in a row (the scale fell 2**64-fold)
# mean no scale helps: the forward pass itself overflows fp16.
FP16_MAX_SKIPS_IN_A_ROW = 64


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LmforgeError(f"train.device={name} but no CUDA device is available: use train.device=cpu")
    return torch.device(name)


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave gains and biases alone (decaying a norm's gain toward
    zero only fights the normalisation). Tied tensors appear once."""
    params = list(dict.fromkeys(model.parameters()))
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model: Transformer, tokens, batch_size: int, seq_len: int, seed: int, batches: int,
             device: torch.device, precision: str = "fp32") -> float:
    """Mean loss over a fixed set of `batches` windows (the same ones at every evaluation),
    computed as training computes it (under the forward autocast of `precision`)."""
    was_training = model.training
    model.eval()
    losses = []
    for index in range(batches):
        x, y = window_batch(tokens, batch_size, seq_len, seed, index)
        with autocast(get_policy(precision), device):
            losses.append(model(x.to(device), y.to(device)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
                 progress: bool = True):
        self.cfg, self.run_dir, self.console, self.progress = cfg, Path(run_dir), console or Console(), progress
        for message in config_warnings(cfg):
            warn(message)
        self.device = resolve_device(cfg.train.device)
        if self.device.type == "cpu":
            retain_freed_memory()
        torch.manual_seed(cfg.train.seed)
        self.data: PreparedData = prepare_data(cfg, log=self.console.print, progress=progress)
        tokenizer_vocab = self.data.meta["tokenizer_vocab_size"]
        if tokenizer_vocab > cfg.model.vocab_size:
            raise LmforgeError(f"the tokenizer in {self.data.dir} has {tokenizer_vocab} tokens but "
                               f"model.vocab_size is {cfg.model.vocab_size}: they must match")
        if len(self.data.val) < cfg.seq_len + 1 or len(self.data.train) < cfg.seq_len + 1:
            raise LmforgeError(f"the corpus is too small for windows of {cfg.seq_len} tokens "
                               f"({len(self.data.train)} train, {len(self.data.val)} val tokens): "
                               f"add text or lower train.seq_len")
        self.model = Transformer(cfg.model).to(self.device)
        # precision and recomputation wrap the model from outside, before the optimizer sees its parameters
        self.policy = get_policy(cfg.train.precision)
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        prepare_model(self.model, self.policy, fp32_attention=cfg.train.fp32_attention,
                      fp8_scaling=cfg.train.fp8_scaling)
        apply_recompute(self.model, cfg.train.recompute)
        self.optimizer = AdamW(weight_decay_groups(self.model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                               betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                               count_lost_updates=self.policy.lossy_updates)
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.bad_in_a_row = 0
        self.step_skipped = False  # whether the last train_step skipped its optimizer step
        self.lost_updates = [0, 0]  # since the last log: elements whose update rounded away, elements updated
        self.lost_updates_total = [0, 0]  # the same over this session
        self.step, self.history = 0, {}
        loader_position = 0
        if resume:
            loader_position = self._restore()
        else:
            self._create_run_dir()
        self.loader = BatchLoader(self.data.train, cfg.train.batch_size, cfg.seq_len, seed=cfg.train.seed,
                                  start=loader_position, prefetch=cfg.data.prefetch, device=self.device)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_step=self.step if resume else None)
        self.tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.seq_len)
        self.hardware_flops_per_token = hardware_flops_per_token(cfg.model, cfg.seq_len, cfg.train.recompute)
        self.peak_dtype = matmul_dtype(cfg.train.precision)
        self.device_label, self.peak_flops, memory = this_device(self.peak_dtype, self.device)
        # The plan, at 100% MFU: its time is a lower bound and measured/predicted throughput is the MFU.
        self.plan = make_plan(cfg.model, Setup.from_config(cfg, mfu=1.0), (self.device_label, self.peak_flops, memory))
        self.measured_memory: dict = {}  # filled in by the first step of the session
        print_plan(self.console, self.plan, title="lmforge train: plan")

    # -- run folder and checkpoints ---------------------------------------------------------------

    def _create_run_dir(self) -> None:
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise LmforgeError(f"run folder {self.run_dir} already exists: continue it with "
                               f"--resume {self.run_dir}, or pick another --name")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        shutil.copyfile(self.data.dir / "tokenizer.json", self.run_dir / "tokenizer.json")

    def _restore(self) -> int:
        path = ckpt.find_checkpoint(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"))
        state = json.loads((path / "state.json").read_text())
        if state["tokenizer_sha256"] != self.data.meta["tokenizer_sha256"]:
            raise LmforgeError(f"checkpoint {path} was trained with another tokenizer than the one in "
                               f"{self.data.dir}: point data.dir at the run's original data")
        precision = state.get("precision", {"policy": "fp32"})  # checkpoints from before policies: fp32
        if precision["policy"] != self.policy.name:
            raise LmforgeError(f"checkpoint {path} was trained with train.precision={precision['policy']}, not "
                               f"{self.policy.name}: resume with the same precision (its optimizer state, "
                               f"loss scale and fp8 scales belong to it), or start a new run")
        ckpt.load_model_weights(self.model, path)
        ckpt.load_optimizer_state(self.optimizer, path, state["param_groups"])
        if "loss_scaler" in precision:
            self.scaler.load_state_dict(precision["loss_scaler"])
        load_fp8_scale_state(self.model, precision.get("fp8_scales", {}))
        self.skipped_steps = precision.get("skipped_steps", 0)
        ckpt.load_rng_states(path)
        self.step, self.history = state["step"], state["history"]
        if self.step >= self.cfg.train.max_steps:
            raise LmforgeError(f"{self.run_dir} already reached step {self.step} of train.max_steps="
                               f"{self.cfg.train.max_steps}: pass a larger train.max_steps to continue")
        before = Schedule.of(load_config(path / "config.yaml"))  # the schedule the checkpoint was trained under
        if self.cfg.optim.decay_steps is None:  # a run from before optim.decay_steps: keep its schedule's length
            self.cfg.optim.decay_steps = before.decay_steps
        save_config(self.cfg, self.run_dir / "config.yaml")  # may carry new train.* settings
        self.console.print(f"resuming {self.run_dir} at step {self.step} ({path.name}): "
                           f"{resume_note(self.step, before, Schedule.of(self.cfg), self.cfg.train.max_steps)}",
                           soft_wrap=True)  # one line, however narrow the terminal
        return state["loader_position"]

    def save(self) -> Path:
        precision = {"policy": self.policy.name, "skipped_steps": self.skipped_steps}
        if self.scaler.enabled:
            precision["loss_scaler"] = self.scaler.state_dict()
        if self.policy.fp8:
            precision["fp8_scales"] = fp8_scale_state(self.model)
        state = {"loader_position": self.loader.position, "history": self.history,
                 "tokenizer_sha256": self.data.meta["tokenizer_sha256"], "precision": precision}
        return ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state,
                                    {"config.yaml": self.run_dir / "config.yaml",
                                     "tokenizer.json": self.run_dir / "tokenizer.json"},
                                    keep=self.cfg.train.keep_checkpoints)

    # -- the loop ---------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the batch, gradient norm before clipping).

        A step whose loss or gradients are not finite is skipped (no update) and `step_skipped`
        set: under fp16-mixed the loss scaler also lowers the scale; the caller decides when too
        many bad steps stop the run."""
        cfg = self.cfg
        lr = Schedule.of(cfg)(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        measure = "activations" not in self.measured_memory  # the first step of a session measures memory
        if measure and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for micro_batch in range(cfg.train.grad_accum):
            x, y = next(self.loader)
            with autocast(self.policy, self.device):
                if measure and micro_batch == 0:
                    with measure_saved_bytes(self.model.parameters()) as saved:
                        loss = self.model(x, y) / cfg.train.grad_accum
                    self.measured_memory["activations"] = saved.activations
                else:
                    loss = self.model(x, y) / cfg.train.grad_accum
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # unscale before clipping, so that the clip threshold applies to the true gradient norm
        found_inf = self.scaler.unscale_(self.model.parameters()) if self.scaler.enabled else False
        if found_inf:
            grad_norm = torch.tensor(float("inf"))
        else:
            grad_norm = clip_grad_norm(self.model.parameters(), cfg.optim.grad_clip)
        self.step_skipped = found_inf or not bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        if not self.step_skipped:
            self.optimizer.step()
            if self.optimizer.count_lost_updates:
                for counts in (self.lost_updates, self.lost_updates_total):
                    counts[0] += self.optimizer.lost_updates
                    counts[1] += self.optimizer.updated_elements
            if "parameters" not in self.measured_memory:  # the first applied step: states exist now
                self.measured_memory.update(model_state_bytes_measured(self.model, self.optimizer))
        else:
            self.skipped_steps += 1
        self.scaler.update(self.step_skipped)
        if measure and self.device.type == "cuda":
            self.measured_memory["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, grad_norm

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate(self.model, self.data.val, t.batch_size, self.cfg.seq_len, t.seed + 1,
                        t.eval_batches, self.device, t.precision)

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.model.train()
        start_step = self.step
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not self.progress)
        train_seconds, window_seconds, window_steps = 0.0, 0.0, 0
        window_loss, window_good = 0.0, 0  # loss summed over the good steps since the last log
        loss = None
        try:
            while self.step < t.max_steps:
                started = time.perf_counter()
                loss_sum, grad_norm = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - started
                train_seconds += elapsed
                window_seconds += elapsed
                window_steps += 1
                bar.update(1)
                step_loss = loss_sum.item()
                self._guard(step_loss, grad_norm.item())
                if not self.step_skipped:
                    window_loss += step_loss
                    window_good += 1
                last = self.step == t.max_steps
                if self.step % t.log_interval == 0 or last:
                    # mean over the window's good steps: less noisy
                    loss = window_loss / window_good if window_good else loss
                    tokens_per_s = window_steps * self.tokens_per_step / window_seconds
                    mfu = tokens_per_s * self.flops_per_token / self.peak_flops
                    record = {"step": self.step, "train_loss": loss, "grad_norm": grad_norm.item(),
                              "lr": self.optimizer.param_groups[0]["lr"],
                              "tokens_per_s": tokens_per_s, "mfu": mfu, "skipped_steps": self.skipped_steps}
                    postfix = f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {mfu:.0%}"
                    if cfg.train.recompute != "none":  # hardware FLOPs include the recomputed forward
                        record["hfu"] = tokens_per_s * self.hardware_flops_per_token / self.peak_flops
                        postfix += f" | HFU {record['hfu']:.0%}"
                    if self.scaler.enabled:
                        record["loss_scale"] = self.scaler.scale_value
                    if self.optimizer.count_lost_updates:
                        lost, updated = self.lost_updates
                        record["lost_update_fraction"] = lost / updated if updated else 0.0
                        self.lost_updates = [0, 0]
                    self.metrics.write(record)
                    bar.set_postfix_str(postfix)
                    window_seconds, window_steps, window_loss, window_good = 0.0, 0, 0.0, 0
                if (t.eval_interval and self.step % t.eval_interval == 0) or last:
                    val_loss = self.evaluate()
                    self.history["val_loss"] = val_loss
                    self.metrics.write({"step": self.step, "val_loss": val_loss})
                    bar.write(f"step {self.step}: val loss {val_loss:.4f}")
                if (t.checkpoint_interval and self.step % t.checkpoint_interval == 0) or last:
                    self.save()
        finally:
            bar.close()
            self.loader.close()
            self.metrics.close()
        self.history["train_loss"] = loss
        return self._finish(start_step, train_seconds)

    def _guard(self, loss: float, grad_norm: float) -> None:
        """Stop the run when bad (skipped) steps keep coming; before this step is checkpointed, so
        the last checkpoint on disk is a good one."""
        bad = self.step_skipped or not math.isfinite(loss)
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        if self.scaler.enabled:
            if self.bad_in_a_row >= FP16_MAX_SKIPS_IN_A_ROW:
                raise LmforgeError(f"{self.bad_in_a_row} steps in a row had inf/NaN gradients up to step "
                                   f"{self.step} (loss scale now {self.scaler.scale_value:g}): fp16 overflows in "
                                   f"the forward pass; the last good checkpoint is kept: use bf16-mixed or "
                                   f"lower optim.lr")
        elif self.bad_in_a_row >= self.cfg.train.max_bad_steps:
            what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
            raise LmforgeError(f"{what} at step {self.step}; the last good checkpoint is kept: lower optim.lr "
                               f"or raise optim.warmup_steps (train.max_bad_steps={self.cfg.train.max_bad_steps} "
                               f"bad steps in a row allowed)")

    # -- after training -----------------------------------------------------------------------------

    def sample(self, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
        tokenizer = self.data.tokenizer
        ids = generate(self.model, tokenizer.encode(prompt).ids, max_new_tokens, temperature=0.8, top_p=0.95,
                       stop_token=tokenizer.token_to_id(END_OF_TEXT), seed=seed)
        return prompt + tokenizer.decode(ids)

    def _finish(self, start_step: int, train_seconds: float) -> dict:
        cfg = self.cfg
        steps = self.step - start_step
        tokens_per_s = steps * self.tokens_per_step / train_seconds if train_seconds else 0.0
        meta = self.data.meta
        val_split = meta["splits"]["val"]
        val_loss = self.history["val_loss"]
        summary = {
            "run_dir": str(self.run_dir),
            "device": device_name(self.device),
            "parameters": self.model.num_params(),
            "steps": self.step,
            "tokens_trained": self.step * self.tokens_per_step,
            "train_seconds_this_session": train_seconds,
            "tokens_per_s": tokens_per_s,
            "flops_per_token": self.flops_per_token,
            "peak_flops_measured": self.peak_flops,
            "mfu": tokens_per_s * self.flops_per_token / self.peak_flops,
            "data_wait_fraction": self.loader.wait_seconds / train_seconds if train_seconds else 0.0,
            "precision": self.policy.name,
            "skipped_steps": self.skipped_steps,
            "lost_update_fraction": (self.lost_updates_total[0] / self.lost_updates_total[1]
                                     if self.lost_updates_total[1] else None),
            "train_loss": self.history["train_loss"],
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "val_bits_per_byte": val_loss * val_split["tokens"] / val_split["bytes"] / math.log(2),
            "unigram_entropy_nats": meta["unigram_entropy_nats"],
        }
        summary["predicted_vs_measured"] = comparison = self._predicted_vs_measured(tokens_per_s)
        plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png",
                    title=f"{self.run_dir.name}: {summary['parameters'] / 1e6:.1f}M parameters",
                    unigram_entropy=meta["unigram_entropy_nats"])
        if cfg.train.sample_tokens:
            summary["sample"] = self.sample(cfg.train.sample_prompt, cfg.train.sample_tokens)
            (self.run_dir / "sample.txt").write_text(summary["sample"])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_table(self.console, [
            ("parameters", f"{summary['parameters'] / 1e6:.2f} M"),
            ("steps", f"{self.step:,} ({summary['tokens_trained']:,} tokens)"),
            ("training time (this session)", f"{train_seconds:.0f} s"),
            ("throughput", f"{tokens_per_s:,.0f} tokens/s"),
            ("MFU", f"{summary['mfu']:.1%}"),
            ("peak, measured", f"{self.peak_flops / 1e9:,.0f} GFLOP/s ({self._timed_dtype()} matmul)"),
            ("device", summary["device"]),
            ("precision", self.policy.name + (", attention in fp32" if cfg.train.fp32_attention else "")),
            ("skipped steps (non-finite)", f"{self.skipped_steps:,}" + (
                f", loss scale now {self.scaler.scale_value:g}" if self.scaler.enabled else "")),
            *([("updates rounded to zero (bf16 weights)", f"{summary['lost_update_fraction']:.2%}")]
              if summary["lost_update_fraction"] is not None else []),
            ("data loader waiting", f"{summary['data_wait_fraction']:.2%} of step time"),
            ("train loss", f"{summary['train_loss']:.4f} nats/token"),
            ("validation loss", f"{val_loss:.4f} nats/token"),
            ("validation perplexity", f"{summary['val_perplexity']:.1f} ({summary['val_bits_per_byte']:.3f} bits/byte)"),
            ("unigram entropy of the corpus", f"{meta['unigram_entropy_nats']:.4f} nats/token"),
            ("run folder", str(self.run_dir)),
        ], title="lmforge train: summary")
        print_comparison(self.console, comparison)
        if cfg.train.sample_tokens:
            self.console.rule("sample")
            self.console.print(summary["sample"], markup=False, highlight=False)
        return summary

    def _timed_dtype(self) -> str:
        timed = str(TIMED_DTYPE[self.peak_dtype]).removeprefix("torch.")
        return timed if timed == self.peak_dtype else f"{timed}, standing in for {self.peak_dtype}"

    def _predicted_vs_measured(self, tokens_per_s: float) -> dict:
        """The plan printed at the start beside what this session measured."""
        plan, measured = self.plan, self.measured_memory
        breakdown = plan["memory"]["breakdown_bytes"]
        activations = plan["memory"]["activation_breakdown_bytes"]
        rows = {
            "tokens_per_s": (plan["time"]["tokens_per_second"], tokens_per_s),
            "mfu": (1.0, tokens_per_s * self.flops_per_token / self.peak_flops),
        }
        if self.cfg.train.recompute != "none":
            rows["hfu"] = (1.0, tokens_per_s * self.hardware_flops_per_token / self.peak_flops)
        for key in ("parameters", "gradients", "optimizer_states"):
            rows[f"{key}_bytes"] = (breakdown[key], measured.get(key))
        # what one micro-batch saves for backward: the layers, embedding, head and the weight casts
        rows["activations_bytes"] = (sum(activations.values()) - activations.get("recomputed_layer", 0)
                                     + breakdown["weight_copies"], measured.get("activations"))
        if "peak_allocated" in measured:
            rows["peak_memory_bytes"] = (plan["memory"]["per_device_bytes"], measured["peak_allocated"])
        return {key: {"predicted": p, "measured": m} for key, (p, m) in rows.items()}
