"""The training loop: data -> model -> AdamW, with evaluation, checkpoints, logs and a summary.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by grad_accum so that the summed gradient equals the gradient of the
mean loss over the whole batch. Then: clip the global gradient norm, set the scheduled learning
rate, AdamW step. Cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.
"""

import json
import math
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from tqdm import tqdm

from lmforge.accounting.flops import hardware_flops_per_token, training_flops_per_token
from lmforge.accounting.hardware import TIMED_DTYPE, device_name, this_device
from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.accounting.plan import Setup, make_plan, matmul_dtype
from lmforge.config import Config, config_to_dict, config_warnings, load_config
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.data.prepare import PreparedData, prepare_data
from lmforge.data.tokenizer import END_OF_TEXT
from lmforge.errors import LmforgeError
from lmforge.folder_lock import FolderLock
from lmforge.generate.sampling import generate
from lmforge.kernels import flash_triton
from lmforge.model.backends import FLASH_BACKENDS
from lmforge.model.transformer import Transformer
from lmforge.optim.clip import clip_grad_norm
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.planning import print_comparison, print_plan
from lmforge.precision import LossScaler, autocast, device_notes, get_policy
from lmforge.precision.policy import fp8_scale_state, load_fp8_scale_state
from lmforge.train import checkpoint as ckpt
from lmforge.train.host_memory import retain_freed_memory
from lmforge.train.report import MetricsLog, plot_losses, print_table, run_title
from lmforge.train.setup import build
from lmforge.train.signals import StopRequests, Stopped
from lmforge.warnings import warn

# Under fp16-mixed a step with inf/NaN gradients is skipped and the loss scale halved: normal at
# the start of a run and now and then later. This many skips in a row (the scale fell 2**64-fold)
# mean no scale helps: the forward pass itself overflows fp16.
FP16_MAX_SKIPS_IN_A_ROW = 64
# train.sample_prompt="" starts the end-of-run sample with this many tokens of a validation document.
SAMPLE_PROMPT_TOKENS = 8


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """The torch device for `name` (auto, cpu, cuda, cuda:N), checked; `setting` names the option
    that gave it, for the message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LmforgeError(f"{setting}={name} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LmforgeError(f"{setting}={name}: lmforge runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmforgeError(f"{setting}={name} but no CUDA device is available: use cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LmforgeError(f"{setting}={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def check_attention(model_cfg, device: torch.device) -> None:
    """What the first forward pass would refuse, refused before the run folder is written."""
    backend = model_cfg.attention
    if backend in FLASH_BACKENDS and model_cfg.dropout > 0:
        raise LmforgeError(f"model.attention={backend} does not support attention dropout "
                           f"(model.dropout={model_cfg.dropout}): set model.dropout=0 or use sdpa or naive")
    if backend == "flash_triton":
        reason = flash_triton.unavailable_reason(device)
        if reason:
            raise LmforgeError(reason)


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
    """One training run in its folder. Setup checks everything (data, model, checkpoint, metrics)
    before it writes anything; from then until `run()` returns the run folder is locked."""

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
        self._check_data()
        check_attention(cfg.model, self.device)
        # AdamW's first update is lr / (1 - beta1) times a unit-sized step (bias correction); beyond
        # float32's range torch cannot even form that factor, and no smaller rate would be sane either.
        if not cfg.optim.lr / (1 - cfg.optim.beta1) < torch.finfo(torch.float32).max:
            raise LmforgeError(f"optim.lr={cfg.optim.lr:g} makes AdamW's first update (lr / (1 - beta1) = "
                               f"{cfg.optim.lr / (1 - cfg.optim.beta1):g}) overflow float32: use a rate below 1")
        # what checkpoints hold besides tensors: from memory, not re-read from the run folder
        self.config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        self.tokenizer_json = self.data.tokenizer.to_str(pretty=True)
        self.policy = get_policy(cfg.train.precision)
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        # the model and everything that wraps it (precision, recomputation), then the optimizer
        self.model, self.optimizer = build(cfg, self.device)
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.bad_in_a_row = 0
        self.step_skipped = False  # whether the last train_step skipped its optimizer step
        self.lost_updates_total = [0, 0]  # this session: elements whose update rounded away, elements updated
        # The logging window: what the next metrics record averages. It is part of the checkpoint,
        # so that a run resumed between two records logs what an uninterrupted one would.
        self.window = {"loss_sum": 0.0, "good_steps": 0, "lost_updates": [0, 0], "last_loss": None}
        self.step, self.history = 0, {}
        for path in (self.run_dir, *self.run_dir.parents):
            if path.exists() and not path.is_dir():
                raise LmforgeError(f"{path} is a file, not a folder: pick another --out or --name")
        self.lock = FolderLock(self.run_dir, "training")
        try:
            loader_position, metrics_kept = self._restore() if resume else self._check_new_run_dir()
            self.loader = BatchLoader(self.data.train, cfg.train.batch_size, cfg.seq_len, seed=cfg.train.seed,
                                      start=loader_position, prefetch=cfg.data.prefetch, device=self.device)
            self.tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len
            self.flops_per_token = training_flops_per_token(cfg.model, cfg.seq_len)
            self.hardware_flops_per_token = hardware_flops_per_token(cfg.model, cfg.seq_len, cfg.train.recompute)
            self.peak_dtype = matmul_dtype(cfg.train.precision)
            self.device_label, self.peak_flops, memory = this_device(self.peak_dtype, self.device)
            # The plan, at 100% MFU: its time is a lower bound and measured/predicted throughput is the MFU.
            self.plan = make_plan(cfg.model, Setup.from_config(cfg, mfu=1.0),
                                  (self.device_label, self.peak_flops, memory))
            self.measured_memory: dict = {}  # filled in by the first step of the session
            # every check has passed: only now is anything in the run folder written
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # on resume: config.yaml may carry new train.* settings, and a damaged copy is repaired
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
            (self.run_dir / "tokenizer.json").write_text(self.tokenizer_json)
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep=metrics_kept)
        except BaseException:
            if hasattr(self, "loader"):
                self.loader.close()
            self.lock.release()
            raise
        print_plan(self.console, self.plan, title="lmforge train: plan")

    def _check_data(self) -> None:
        cfg, data = self.cfg, self.data
        tokenizer_vocab = data.meta["tokenizer_vocab_size"]
        if tokenizer_vocab > cfg.model.vocab_size:
            raise LmforgeError(f"the tokenizer in {data.dir} has {tokenizer_vocab} tokens but "
                               f"model.vocab_size is {cfg.model.vocab_size}: they must match")
        if tokenizer_vocab < cfg.model.vocab_size:
            # Allowed, since padding the vocabulary (e.g. to a multiple of 64) is a real speed trick;
            # but usually the corpus was too small for the BPE trainer to learn that many tokens.
            self.console.print(f"warning: the tokenizer in {data.dir} has {tokenizer_vocab} tokens, "
                               f"model.vocab_size is {cfg.model.vocab_size}: the other "
                               f"{cfg.model.vocab_size - tokenizer_vocab} embedding rows are never "
                               f"used (set model.vocab_size={tokenizer_vocab} unless that padding is on purpose)")
        if len(data.val) < cfg.seq_len + 1 or len(data.train) < cfg.seq_len + 1:
            raise LmforgeError(f"the corpus is too small for windows of {cfg.seq_len} tokens "
                               f"({len(data.train)} train, {len(data.val)} val tokens): "
                               f"add text or lower train.seq_len")

    # -- run folder and checkpoints ---------------------------------------------------------------

    def _check_new_run_dir(self) -> tuple[int, list[str]]:
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise LmforgeError(f"run folder {self.run_dir} already exists: continue it with "
                               f"--resume {self.run_dir}, or pick another --name")
        return 0, []

    def _restore(self) -> tuple[int, list[str]]:
        """Load the newest good checkpoint; returns the loader position and the metrics lines to
        keep. Reads only: the caller writes once every check has passed."""
        ckpt.remove_partials(self.run_dir)  # a save killed half way: ours to clean now that we hold the lock
        path = ckpt.find_checkpoint(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"))
        state = json.loads((path / "state.json").read_text())
        ckpt.check_format(path, state)
        if state["tokenizer_sha256"] != self.data.meta["tokenizer_sha256"]:
            raise LmforgeError(f"checkpoint {path} was trained with another tokenizer than the one in "
                               f"{self.data.dir}: point data.dir at the run's original data")
        precision = state.get("precision", {"policy": "fp32"})  # checkpoints from before policies: fp32
        if precision["policy"] != self.policy.name:
            raise LmforgeError(f"checkpoint {path} was trained with train.precision={precision['policy']}, not "
                               f"{self.policy.name}: resume with the same precision (its optimizer state, "
                               f"loss scale and fp8 scales belong to it), or start a new run")
        step = state["step"]
        finished = (self.run_dir / "summary.json").is_file()
        if step > self.cfg.train.max_steps or (step == self.cfg.train.max_steps and finished):
            raise LmforgeError(f"{self.run_dir} already reached step {step} of train.max_steps="
                               f"{self.cfg.train.max_steps}: pass a larger train.max_steps to continue")
        metrics_kept = MetricsLog.lines_to_keep(self.run_dir / "metrics.jsonl", step,
                                                warn=lambda msg: self.console.print(f"warning: {msg}"))
        ckpt.load_model_weights(self.model, path)
        ckpt.load_optimizer_state(self.model, self.optimizer, path, state["param_groups"])
        if "loss_scaler" in precision:
            self.scaler.load_state_dict(precision["loss_scaler"])
        load_fp8_scale_state(self.model, precision.get("fp8_scales", {}))
        self.skipped_steps = precision.get("skipped_steps", 0)
        ckpt.load_rng_states(path)
        self.step, self.history = step, state["history"]
        self.window = state.get("window", self.window)
        self.bad_in_a_row = state.get("bad_in_a_row", 0)
        if step == self.cfg.train.max_steps:
            self.console.print(f"{self.run_dir} reached step {step} but stopped before its summary: writing it")
        else:
            before = Schedule.of(load_config(path / "config.yaml"))  # the schedule the checkpoint was trained under
            self.console.print(f"resuming {self.run_dir} at step {step} ({path.name}): "
                               f"{resume_note(step, before, Schedule.of(self.cfg), self.cfg.train.max_steps)}",
                               soft_wrap=True)  # one line, however narrow the terminal
        return state["loader_position"], metrics_kept

    def save(self) -> Path:
        precision = {"policy": self.policy.name, "skipped_steps": self.skipped_steps}
        if self.scaler.enabled:
            precision["loss_scaler"] = self.scaler.state_dict()
        if self.policy.fp8:
            precision["fp8_scales"] = fp8_scale_state(self.model)
        state = {"loader_position": self.loader.position, "history": self.history,
                 "tokenizer_sha256": self.data.meta["tokenizer_sha256"], "precision": precision,
                 "window": self.window, "bad_in_a_row": self.bad_in_a_row}
        return ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state,
                                    {"config.yaml": self.config_yaml.encode(),
                                     "tokenizer.json": self.tokenizer_json.encode()},
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
                for counts in (self.window["lost_updates"], self.lost_updates_total):
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
        """Train to train.max_steps, then write the summary. SIGTERM or Ctrl-C: finish the step,
        save a checkpoint and raise `Stopped`. The run folder's lock is released on return."""
        start_step = self.step
        try:
            with StopRequests() as stop:
                train_seconds = self._loop(stop)
            return self._finish(start_step, train_seconds)
        finally:
            self.lock.release()

    def _loop(self, stop: StopRequests) -> float:
        """The steps; returns the seconds they took."""
        cfg, t, window = self.cfg, self.cfg.train, self.window
        self.model.train()
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not self.progress)
        train_seconds, window_seconds, window_steps = 0.0, 0.0, 0  # timing: this session only
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
                    window["loss_sum"] += step_loss
                    window["good_steps"] += 1
                last = self.step == t.max_steps
                if self.step % t.log_interval == 0 or last:
                    # mean over the window's good steps: less noisy
                    if window["good_steps"]:
                        window["last_loss"] = window["loss_sum"] / window["good_steps"]
                    loss = window["last_loss"]
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
                        lost, updated = window["lost_updates"]
                        record["lost_update_fraction"] = lost / updated if updated else 0.0
                    self.metrics.write(record)
                    bar.set_postfix_str(postfix)
                    window.update(loss_sum=0.0, good_steps=0, lost_updates=[0, 0])
                    window_seconds, window_steps = 0.0, 0
                if (t.eval_interval and self.step % t.eval_interval == 0) or last:
                    val_loss = self.evaluate()
                    self.history["val_loss"] = val_loss
                    self.metrics.write({"step": self.step, "val_loss": val_loss})
                    bar.write(f"step {self.step}: val loss {val_loss:.4f}")
                saved = None
                if (t.checkpoint_interval and self.step % t.checkpoint_interval == 0) or last:
                    saved = self.save()
                if stop.received is not None:
                    raise Stopped(stop.received, self.step, saved or self.save())
        finally:
            bar.close()
            self.loader.close()
            self.metrics.close()
        self.history["train_loss"] = window["last_loss"]
        return train_seconds

    def _guard(self, loss: float, grad_norm: float) -> None:
        """Stop the run when bad (skipped) steps keep coming; before this step is checkpointed, so
        the last checkpoint on disk is a good one."""
        bad = self.step_skipped or not math.isfinite(loss)
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        if self.scaler.enabled:
            if self.bad_in_a_row >= FP16_MAX_SKIPS_IN_A_ROW:
                raise LmforgeError(f"{self.bad_in_a_row} steps in a row had inf/NaN gradients up to step "
                                   f"{self.step} (loss scale now {self.scaler.scale_value:g}): fp16 overflows in "
                                   f"the forward pass; " + ckpt.kept_checkpoint(
                                       self.run_dir, "use bf16-mixed or lower optim.lr"))
        elif self.bad_in_a_row >= self.cfg.train.max_bad_steps:
            what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
            raise LmforgeError(f"{what} at step {self.step}; " + ckpt.kept_checkpoint(
                self.run_dir, f"lower optim.lr or raise optim.warmup_steps (train.max_bad_steps="
                              f"{self.cfg.train.max_bad_steps} bad steps in a row allowed)"))

    # -- after training -----------------------------------------------------------------------------

    def default_prompt(self) -> str:
        """The start of the first validation document: a sample prompt in the corpus's own language."""
        tokenizer = self.data.tokenizer
        end = tokenizer.token_to_id(END_OF_TEXT)
        start = self.data.val[:SAMPLE_PROMPT_TOKENS].tolist()
        return tokenizer.decode(start[:start.index(end)] if end in start else start)

    def sample(self, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
        """`prompt` and its continuation."""
        tokenizer = self.data.tokenizer
        end = tokenizer.token_to_id(END_OF_TEXT)
        ids = generate(self.model, tokenizer.encode(prompt).ids or [end], max_new_tokens, temperature=0.8,
                       top_p=0.95, stop_token=end, seed=seed)
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
                    title=run_title(self.run_dir.name, cfg, summary["parameters"]),
                    unigram_entropy=meta["unigram_entropy_nats"], tokens_per_step=self.tokens_per_step)
        if cfg.train.sample_tokens:
            summary["sample_prompt"] = cfg.train.sample_prompt or self.default_prompt()
            summary["sample"] = self.sample(summary["sample_prompt"], cfg.train.sample_tokens)
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
