"""The training loop: data -> model -> AdamW, with evaluation, checkpoints and logs.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by grad_accum so that the summed gradient equals the gradient of the
mean loss over the whole batch. Then: clip the global gradient norm, set the scheduled learning
rate, AdamW step. Cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.

A run is read in this order: train/setup.py builds the model and optimizer, this file trains,
train/state.py keeps the run folder and its checkpoints, train/report.py logs each record and
train/summary.py writes the end of the run.
"""

import functools
import math
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console

from lmforge.accounting.flops import hardware_flops_per_token, training_flops_per_token
from lmforge.accounting.hardware import this_device
from lmforge.accounting.plan import Setup, make_plan, matmul_dtype
from lmforge.config import Config, config_to_dict, config_warnings, load_config
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.data.prepare import PreparedData, prepare_data
from lmforge.errors import LmforgeError
from lmforge.model.transformer import Transformer
from lmforge.optim.clip import clip_grad_norm
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.planning import print_plan
from lmforge.precision import LossScaler, autocast, device_notes, get_policy
from lmforge.precision.policy import fp8_scale_state, load_fp8_scale_state
from lmforge.train import checkpoint as ckpt
from lmforge.train.report import StepLog, training_record
from lmforge.train.finetune import check_same_base, prepare_finetune
from lmforge.train.setup import build, check_attention, check_data, resolve_device
from lmforge.train.signals import StopRequests, Stopped
from lmforge.train.state import RunFolder, RunState
from lmforge.train.summary import FirstStepMeasurement, write_summary
from lmforge.warnings import warn

# Under fp16-mixed a step with inf/NaN gradients is skipped and the loss scale halved: normal at
# the start of a run and now and then later. This many skips in a row (the scale fell 2**64-fold)
# mean no scale helps: the forward pass itself overflows fp16.
FP16_MAX_SKIPS_IN_A_ROW = 64


@torch.no_grad()
def evaluate(model: Transformer, tokens, batch_size: int, seq_len: int, seed: int, batches: int,
             device: torch.device, precision: str = "fp32", make_batch=window_batch) -> float:
    """Mean loss over a fixed set of `batches` windows (the same ones at every evaluation),
    computed as training computes it (under the forward autocast of `precision`); `make_batch`
    draws them (fine-tuning examples: data/sft.py's example_batch)."""
    was_training = model.training
    model.eval()
    losses = []
    for index in range(batches):
        x, y = make_batch(tokens, batch_size, seq_len, seed, index)
        with autocast(get_policy(precision), device):
            losses.append(model(x.to(device), y.to(device)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


class Trainer:
    """One training run in its folder. Setup locks the folder, then checks everything (data, model,
    checkpoint, metrics) before it writes anything; the lock is held until `run()` returns.

    `machine(matmul_dtype, device)` gives (name, peak FLOP/s, memory bytes) of the device for MFU
    and the plan, once the checks have passed; by default accounting.hardware.this_device, reading
    the measured peak from the cache `lmforge` keeps but never writing to it (the CLI does)."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
                 progress: bool = True, machine=functools.partial(this_device, store=False)):
        self.cfg, self.run_dir, self.console, self.progress = cfg, Path(run_dir), console or Console(), progress
        for message in config_warnings(cfg):
            warn(message)
        self.device = resolve_device(cfg.train.device)
        check_attention(cfg.model, self.device)
        torch.manual_seed(cfg.train.seed)
        if cfg.finetune.base is None:
            self.data: PreparedData = prepare_data(cfg, log=self.console.print, progress=progress)
            check_data(cfg, self.data, warn=lambda msg: self.console.print(f"warning: {msg}"))
            self.base_state = self.base_identity = None
        else:  # fine-tuning: the base's weights and tokenizer (train/finetune.py)
            self.data, self.base_state, self.base_identity = prepare_finetune(cfg, log=self.console.print)
        # the run folder is locked from here on: a second writer is refused before the model is built
        self.folder = RunFolder(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"))
        try:
            self._setup(resume, machine)
        except BaseException:
            self.close()
            raise
        print_plan(self.console, self.plan, title="lmforge train: plan")

    def _setup(self, resume: bool, machine) -> None:
        cfg = self.cfg
        checkpoint = self.folder.latest_checkpoint() if resume else self.folder.check_new()
        # what checkpoints hold besides tensors: from memory, not re-read from the run folder
        self.config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        self.tokenizer_json = self.data.tokenizer.to_str(pretty=True)
        self.policy = get_policy(cfg.train.precision)
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        # the model and everything that wraps it (precision, recomputation), then the optimizer
        self.model, self.optimizer = build(cfg, self.device, self.base_state)
        self.base_state = None  # copied into the model: let it go
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        self.lost_updates_total = [0, 0]  # this session: elements whose update rounded away, elements updated
        self.state, metrics_kept = RunState(), None
        if resume:
            self.state, metrics_kept = self._restore(*checkpoint)
        self.loader = BatchLoader(self.data.train, cfg.train.batch_size, cfg.seq_len, seed=cfg.train.seed,
                                  start=self.state.loader_position, prefetch=cfg.data.prefetch, device=self.device,
                                  make_batch=getattr(self.data, "batches", window_batch))
        self.tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.seq_len)
        self.hardware_flops_per_token = hardware_flops_per_token(cfg.model, cfg.seq_len, cfg.train.recompute)
        self.peak_dtype = matmul_dtype(cfg.train.precision)
        machine = machine(self.peak_dtype, self.device)
        self.device_label, self.peak_flops, _ = machine
        # The plan, at 100% MFU: its time is a lower bound and measured/predicted throughput is the MFU.
        self.plan = make_plan(cfg.model, Setup.from_config(cfg, mfu=1.0), machine)
        # every check has passed: only now is anything in the run folder written
        self.folder.write_start(self.config_yaml, self.tokenizer_json)
        self.log = StepLog(self.run_dir, cfg, self.console, self.progress, self.state.step, keep=metrics_kept)

    # -- checkpoints ------------------------------------------------------------------------------

    def _restore(self, path: Path, state: dict) -> tuple[RunState, list[str]]:
        """Load checkpoint `path` once it is checked to fit this run; reads only."""
        check_same_base(state.get("base"), self.base_identity, path)
        run, metrics_kept = self.folder.restore(path, state, self.model, self.optimizer, self.cfg,
                                                self.policy.name, self.data)
        precision = state["precision"]
        if "loss_scaler" in precision:
            self.scaler.load_state_dict(precision["loss_scaler"])
        load_fp8_scale_state(self.model, precision.get("fp8_scales", {}))
        if run.step == self.cfg.train.max_steps:
            self.console.print(f"{self.run_dir} reached step {run.step} but stopped before its summary: writing it")
        else:
            before = Schedule.of(load_config(path / "config.yaml"))  # the schedule the checkpoint was trained under
            self.console.print(f"resuming {self.run_dir} at step {run.step} ({path.name}): "
                               f"{resume_note(run.step, before, Schedule.of(self.cfg), self.cfg.train.max_steps)}",
                               soft_wrap=True)  # one line, however narrow the terminal
        return run, metrics_kept

    def save(self) -> Path:
        precision = {"policy": self.policy.name}
        if self.scaler.enabled:
            precision["loss_scaler"] = self.scaler.state_dict()
        if self.policy.fp8:
            precision["fp8_scales"] = fp8_scale_state(self.model)
        self.state.loader_position = self.loader.position
        extra = {"tokenizer_sha256": self.data.meta["tokenizer_sha256"], "precision": precision}
        if self.base_identity is not None:
            extra["base"] = self.base_identity  # a LoRA checkpoint holds only the adapters: which base they fit
        return self.folder.save(self.state, self.model, self.optimizer, extra,
                                {"config.yaml": self.config_yaml.encode(), "tokenizer.json": self.tokenizer_json.encode()},
                                keep=self.cfg.train.keep_checkpoints)

    # the loop's counters live in the run state (they are checkpointed); read them by these names
    step = property(lambda self: self.state.step)
    skipped_steps = property(lambda self: self.state.skipped_steps)
    history = property(lambda self: self.state.history)

    # -- the loop ---------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the batch, gradient norm before clipping).

        A step whose loss or gradients are not finite is skipped (no update) and `step_skipped`
        set: under fp16-mixed the loss scaler also lowers the scale; the caller decides when too
        many bad steps stop the run."""
        cfg, state = self.cfg, self.state
        lr = Schedule.of(cfg)(state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(cfg.train.grad_accum):
            x, y = next(self.loader)
            with autocast(self.policy, self.device):
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
                for counts in (state.window["lost_updates"], self.lost_updates_total):
                    counts[0] += self.optimizer.lost_updates
                    counts[1] += self.optimizer.updated_elements
        else:
            state.skipped_steps += 1
        self.scaler.update(self.step_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return loss_sum, grad_norm

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate(self.model, self.data.val, t.batch_size, self.cfg.seq_len, t.seed + 1,
                        t.eval_batches, self.device, t.precision, getattr(self.data, "batches", window_batch))

    def run(self) -> dict:
        """Train to train.max_steps, then write the summary. SIGTERM or Ctrl-C: finish the step,
        save a checkpoint and raise `Stopped`. The run folder's lock is released on return."""
        start_step = self.step
        self.measured = FirstStepMeasurement(self.model, self.optimizer, self.device)
        try:
            with StopRequests() as stop:
                train_seconds = self._loop(stop)
            return write_summary(self, start_step, train_seconds)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the loader, close the logs, remove the measuring hooks, release the folder."""
        for part in ("loader", "log", "measured"):  # whichever setup got to build
            if hasattr(self, part):
                getattr(self, part).close()
        self.folder.release()

    def _loop(self, stop: StopRequests) -> float:
        """The steps; returns the seconds they took."""
        t, state, window = self.cfg.train, self.state, self.state.window
        self.model.train()
        session_start = time.time()
        train_seconds, window_seconds, window_steps = 0.0, 0.0, 0  # timing: this session only
        while state.step < t.max_steps:
            started = time.perf_counter()
            loss_sum, grad_norm = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            train_seconds += elapsed
            window_seconds += elapsed
            window_steps += 1
            self.log.advance()
            step_loss = loss_sum.item()
            self._guard(step_loss, grad_norm.item())
            if not self.step_skipped:
                window["loss_sum"] += step_loss
                window["good_steps"] += 1
            last = state.step == t.max_steps
            if state.step % t.log_interval == 0 or last:
                steps_per_second = window_steps / window_seconds
                self.log.record(training_record(self, grad_norm.item(), steps_per_second, session_start),
                                steps_per_second)
                window.update(loss_sum=0.0, good_steps=0, lost_updates=[0, 0])
                window_seconds, window_steps = 0.0, 0
            if (t.eval_interval and state.step % t.eval_interval == 0) or last:
                val_loss = self.evaluate()
                state.history["val_loss"] = val_loss
                self.log.record({"step": state.step, "val_loss": val_loss, "time": time.time()})
                self.log.note(f"step {state.step}: val loss {val_loss:.4f}")
            saved = None
            if (t.checkpoint_interval and state.step % t.checkpoint_interval == 0) or last:
                saved = self.save()
            if stop.received is not None:
                raise Stopped(stop.received, state.step, saved or self.save())
        state.history["train_loss"] = window["last_loss"]
        return train_seconds

    def _guard(self, loss: float, grad_norm: float) -> None:
        """Stop the run when bad (skipped) steps keep coming; before this step is checkpointed, so
        the last checkpoint on disk is a good one."""
        state = self.state
        bad = self.step_skipped or not math.isfinite(loss)
        state.bad_in_a_row = state.bad_in_a_row + 1 if bad else 0
        if self.scaler.enabled:
            if state.bad_in_a_row >= FP16_MAX_SKIPS_IN_A_ROW:
                raise LmforgeError(f"{state.bad_in_a_row} steps in a row had inf/NaN gradients up to step "
                                   f"{state.step} (loss scale now {self.scaler.scale_value:g}): fp16 overflows in "
                                   f"the forward pass; " + ckpt.kept_checkpoint(
                                       self.run_dir, "use bf16-mixed or lower optim.lr"))
        elif state.bad_in_a_row >= self.cfg.train.max_bad_steps:
            what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
            raise LmforgeError(f"{what} at step {state.step}; " + ckpt.kept_checkpoint(
                self.run_dir, f"lower optim.lr or raise optim.warmup_steps (train.max_bad_steps="
                              f"{self.cfg.train.max_bad_steps} bad steps in a row allowed)"))
