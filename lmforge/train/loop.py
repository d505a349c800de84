"""The training loop: data -> model -> AdamW, with evaluation, checkpoints and logs.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by its share of the step's target tokens (over every micro-batch and
rank: grad_accum for text windows, where every position is a target), so that the summed gradient
is the gradient of the mean loss over all the step's targets. Then: clip the global gradient norm, set the scheduled learning
rate, AdamW step. Cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.

Under torchrun every rank runs this loop in lockstep (forward, backward, evaluation, checkpoints:
a sharded model needs every rank in every forward); `train.batch_size` is per rank, and rank 0
alone prints, logs and writes reports. The loss logged is the mean over the ranks, and tokens/s,
the global batch and MFU count all of them (lmforge/parallel/world.py).

A run is read in this order: train/setup.py builds the model and optimizer, this file trains,
runs/state.py keeps the run folder and its checkpoints, train/measurements.py holds what the run
measures, train/report.py logs each record and train/summary.py writes the end of the run.
"""

import dataclasses
import functools
import time
from pathlib import Path

import torch
from rich.console import Console

from lmforge.accounting.hardware import this_device
from lmforge.accounting.plan.costing import Costing, data_parallel
from lmforge.accounting.plan.make import make_plan, matmul_dtype
from lmforge.accounting.plan.show import print_plan
from lmforge.accounting.scaling import predicted_loss, read_fit
from lmforge.accounting.shapes import model_shapes
from lmforge.accounting.roofline_measure import measure_collective
from lmforge.accounting.roofline_shapes import cached_step_roof
from lmforge.common.errors import warn
from lmforge.config import Config, config_warnings
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.modes.precision import Policy, get_policy
from lmforge.optim.schedule import Schedule
from lmforge.parallel.cp_model import ring_traffic
from lmforge.parallel.parallelize import Engine
from lmforge.parallel.pipeline.report import pipeline_report
from lmforge.parallel.pipeline.timeline import Timeline
from lmforge.parallel.world import World, init_world, is_collective_failure
from lmforge.precision.loss_scaler import LossScaler
from lmforge.precision.policy import device_notes
from lmforge.runs.state import RunFolder, RunState
from lmforge.train.checkpoints import Checkpoints
from lmforge.train.evaluate import evaluate
from lmforge.train.finetune import prepare_run_data
from lmforge.train.guard import check_bad_steps
from lmforge.train.measurements import FirstStepMeasurement, WindowClock, rank_share, start_measurements
from lmforge.train.report import SilentLog, StepLog, training_record
from lmforge.train.setup import build_engine, check_attention, check_memory
from lmforge.train.signals import StopRequests, Stopped
from lmforge.train.summary import TARGET_REACHED, write_summary


def train_step(engine: Engine, next_batch, grad_accum: int, lr: float, grad_clip: float, scaler: LossScaler,
               policy: Policy, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step of any data-parallel engine (lmforge/parallel/): `grad_accum` micro-batches
    from `next_batch()`, communicating only in the last one's backward; then unscale (fp16) and clip
    the global gradient norm, and the AdamW step at `lr` unless the loss or the gradients are not
    finite. Returns (loss of the step averaged over ranks, gradient norm before clipping, skipped).

    The step's loss is the mean over all its target tokens (every micro-batch, every rank): the
    engine divides each micro-batch loss by its share of them (parallel/engine.py, loss_divisors;
    grad_accum where the micro-batches hold as many) and averages the gradients over the ranks."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = engine.forward_backward(next_batch, grad_accum, scaler, policy, device)
    engine.finish_gradients()
    # unscale before clipping, so that the clip threshold applies to the true gradient norm
    found_inf, grad_norm = engine.unscale_and_clip(scaler, grad_clip)
    loss_sum = engine.mean_across_ranks(loss_sum)
    skipped = found_inf or not bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
    if not skipped:
        engine.step()
    scaler.update(skipped)
    engine.zero_grad()
    return loss_sum, grad_norm, skipped


class Trainer:
    """One training run in its folder. Setup locks the folder, then checks everything (data, model,
    checkpoint, metrics) before it writes anything; the lock is held until `run()` returns.

    `machine(matmul_dtype, device)` gives (name, peak FLOP/s, memory bytes) of the device for MFU
    and the plan, once the checks have passed; by default accounting.hardware.this_device, reading
    the measured peak from the cache `lmforge` keeps but never writing to it (the CLI does).
    `roof(device, config, dp)` gives the measured roofline (accounting/roofline_measure.py)
    with the rates of the step's own matmul shapes (roofline_shapes.py) behind the plan's step
    time, or None; by default read from the cache alone (the CLI measures what is absent).

    `world`: this process's place under torchrun; by default read from the environment (and the
    process group joined), a single process outside torchrun."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
                 progress: bool = True, machine=functools.partial(this_device, store=False),
                 world: World | None = None, roof=cached_step_roof):
        self.world = world if world is not None else init_world(cfg)  # a launch that cannot work stops here
        main = self.world.is_main
        # rank 0's folder for all (a default name holds the time, which the ranks may read a second apart)
        self.cfg, self.run_dir = cfg, Path(self.world.from_main(lambda: str(run_dir)))
        self.console = (console or Console()) if main else Console(quiet=True)
        self.progress = progress and main
        if main:
            for message in config_warnings(cfg):
                warn(message)
        self.device = self.world.device
        check_attention(cfg.model, self.device)
        torch.manual_seed(cfg.train.seed)  # the same on every rank: the same initial model
        self.data, self.base_state, self.base_identity = prepare_run_data(
            cfg, self.world, log=self.console.print, warn=lambda msg: self.console.print(f"warning: {msg}"),
            progress=self.progress)
        # the run folder is locked (by rank 0) from here on: a second writer is refused before the model is built
        self.folder = self.world.main_first(
            lambda: RunFolder(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"), world=self.world))
        try:
            self._setup(resume, machine, roof)
        except BaseException:
            self.close()
            raise
        print_plan(self.console, self.plan, title="lmforge train: plan")

    def _setup(self, resume: bool, machine, roof) -> None:
        """Build, restore and measure, checking as it goes; then the run folder's first files."""
        cfg = self.cfg
        checkpoint = self.world.from_main(self.folder.latest_checkpoint if resume else self.folder.check_new)
        engine = self._build()
        self.checkpoints = Checkpoints(self.folder, cfg, self.data, engine, self.policy, self.scaler,
                                       self.base_identity, self.global_batch)
        self.state, metrics_kept = (self.checkpoints.restore(*checkpoint, self.console) if resume
                                    else (RunState(), None))
        self._measure(machine, roof)
        check_memory(self.plan, cfg)  # before the loader draws a batch that cannot fit
        # fine-tuning examples draw their own batches (train/finetune.py); text, windows of its tokens
        self.make_batch = getattr(self.data, "batches", window_batch)
        # each replica of the model draws its rows of the global batch (every stage of a pipeline the same)
        self.loader = BatchLoader(self.data.train, cfg.train.batch_size, cfg.seq_len, seed=cfg.train.seed,
                                  start=self.state.loader_position, prefetch=cfg.data.prefetch, device=self.device,
                                  rank=engine.replica, world_size=engine.replicas, make_batch=self.make_batch)
        # every check has passed: only now is anything in the run folder written, by rank 0 alone
        if self.world.is_main:
            self.checkpoints.write_start()
            self.log = StepLog(self.run_dir, cfg, self.console, self.progress, self.state.step, keep=metrics_kept)
        else:
            self.log = SilentLog()

    def _build(self) -> Engine:
        """The model and everything that wraps it (precision, recomputation, LoRA, parallelism),
        the optimizer, and the loss scaler of the precision policy."""
        cfg = self.cfg
        self.policy = get_policy(cfg.train.precision)
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        self.timeline = Timeline() if cfg.train.pipeline_stages > 1 else None  # what each pipeline step did, when
        self.engine = build_engine(cfg, self.policy, self.device, self.base_state, timeline=self.timeline)
        self.model, self.optimizer = self.engine.model, self.engine.optimizer
        self.ring = ring_traffic(self.model)  # the cp ring's sent bytes (None without cp)
        self.base_state = None  # copied into the model: let it go
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        # sequences per optimizer step: every replica's micro-batches
        self.global_batch = (cfg.train.batch_size * self.engine.replicas * cfg.train.grad_accum
                             * cfg.train.micro_batches)
        return self.engine

    def _measure(self, machine, roof) -> None:
        """The run's measurements record (train/measurements.py) and the plan to set them beside."""
        cfg, engine = self.cfg, self.engine
        # measured by rank 0; each rank has its share
        machine = rank_share(self.world.measured_on_main(lambda: machine(matmul_dtype(cfg.train.precision), self.device),
                                                         "measure this machine's matmul peak"), self.device)
        self.measurements = start_measurements(
            cfg, engine, self.world, self.state, self.policy.name,
            loss_scale=self.scaler.scale_value if self.scaler.enabled else None,
            tokens_per_step=self.global_batch * cfg.seq_len, peak_flops=machine[1])
        # The plan's time estimates at 100% MFU (a bound); the roofline below predicts the step's time.
        dp = data_parallel(cfg, self.world.world_size)
        # the roofline's step time; under torchrun with data parallelism, all-reduce measured on every rank
        collective = measure_collective() if self.world.world_size > 1 and cfg.train.pipeline_stages == 1 else None
        measured_roof = self.world.measured_on_main(lambda: roof(self.device, cfg, dp),
                                                    "measure this machine's roofline")
        if measured_roof is not None and collective is not None:
            measured_roof = dataclasses.replace(measured_roof, collective=collective)
        self.plan = make_plan(cfg, Costing(dp=dp, mfu=1.0), machine, measured_roof)
        if cfg.train.scaling_fit:  # what the fit says this run's tokens buy (a bad file stops here, before any write)
            fit = read_fit(cfg.train.scaling_fit, option="train.scaling_fit")
            self.plan["scaling"] = predicted_loss(fit, model_shapes(cfg.model).matmul_weights,
                                                  cfg.train.max_steps * self.global_batch * cfg.seq_len)

    def save(self) -> Path:
        self.state.loader_position = self.loader.position
        return self.checkpoints.save(self.state)

    # the loop's counters live in the run state (they are checkpointed); read them by these names
    step = property(lambda self: self.state.step)
    skipped_steps = property(lambda self: self.state.skipped_steps)

    # -- the loop ---------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the batch, gradient norm before clipping).

        A step whose loss or gradients are not finite is skipped (no update) and `step_skipped`
        set: under fp16-mixed the loss scaler also lowers the scale; the caller decides when too
        many bad steps stop the run."""
        cfg, state, run = self.cfg, self.state, self.measurements
        tp_comm = getattr(self.engine, "tp_comm", None)  # its training traffic only: evaluation sends too
        tp_before = tp_comm.sent_bytes("tp") if tp_comm is not None else 0.0
        ring_before = sum(self.ring.bytes.values()) if self.ring is not None else 0
        loss_sum, grad_norm, self.step_skipped = train_step(
            self.engine, lambda: next(self.loader), cfg.train.grad_accum, Schedule.of(cfg)(state.step),
            cfg.optim.grad_clip, self.scaler, self.policy, self.device)
        if tp_comm is not None:
            run.tp_sent_bytes = (run.tp_sent_bytes or 0.0) + tp_comm.sent_bytes("tp") - tp_before
        if self.ring is not None:
            run.cp_sent_bytes = (run.cp_sent_bytes or 0.0) + sum(self.ring.bytes.values()) - ring_before
        if self.step_skipped:
            state.skipped_steps += 1
        elif run.lost_updates is not None:
            for counts in (state.window["lost_updates"], run.lost_updates):
                counts[0] += self.optimizer.lost_updates
                counts[1] += self.optimizer.updated_elements
        if self.scaler.enabled:
            run.loss_scale = self.scaler.scale_value
        state.step += 1
        return loss_sum, grad_norm

    def run(self) -> dict:
        """Train to train.max_steps, then write the summary. SIGTERM or Ctrl-C: finish the step,
        save a checkpoint and raise `Stopped`. The run folder's lock is released on return."""
        run = self.measurements
        self.measuring = FirstStepMeasurement(self.engine, self.device, into=run.first_step)
        # a SIGTERM is only recorded until the error (if any) is said: torchrun sends one to the
        # survivors the moment a rank dies, while they find out who (train/signals.py)
        many = self.world.world_size > 1
        with StopRequests(stuck=self.world.report_stuck if many else None,
                          alive=self.world.answer_roll_call if many else None) as stop:
            try:
                self._loop(stop)
                run.data_wait_seconds = self.loader.wait_seconds
                run.sent_bytes = self.engine.comm.sent_bytes() if self.engine.comm is not None else None
                if self.timeline is not None:
                    run.pipeline = pipeline_report(self.engine, self.timeline.events, self.cfg, run.first_step,
                                                   self.step, self.run_dir, self.world.is_main)
                return write_summary(run, self.cfg, self.plan, self.data, self.model, self.run_dir, self.console,
                                     self.world.is_main)
            except Exception as err:
                if self.world.world_size > 1 and is_collective_failure(err):  # a rank died or hangs
                    raise self.world.failure(err) from None
                raise
            finally:
                self.close()

    def close(self) -> None:
        """Stop the loader, close the logs, remove the measuring hooks, release the folder."""
        for part in ("loader", "log", "measuring"):  # whichever setup got to build
            if hasattr(self, part):
                getattr(self, part).close()
        self.folder.release()

    def _loop(self, stop: StopRequests) -> None:
        """The steps, timed into the measurements (the compile apart, see WindowClock).

        Host-device synchronisation: on CUDA, the loss and the time are read back once per log
        interval (and before a checkpoint), not per step: the window's loss is summed on the
        device, in float64 from the window's saved sum, so that its value is bit for bit the one a
        per-step sum on the host gives (exact resume inside a window). The one sync per step left
        is train_step's check that the step is finite before it is applied (a guard must know
        that in time); the guard that stops a run after bad steps reads the loss only then.
        Worst case of the deferral: none for correctness (a skipped step is known at once); a
        run's last log record waits for the device like any other."""
        t, state, window = self.cfg.train, self.state, self.state.window
        self.model.train()
        self.measurements.started = time.time()
        clock = WindowClock(self.measurements, compiling=t.compile)
        window_loss = torch.tensor(window["loss_sum"], dtype=torch.float64, device=self.device)
        # a run that reached train.target_loss (train/checkpoints.py lets one resume only to write its summary)
        while state.step < t.max_steps and TARGET_REACHED not in state.history:
            loss_sum, grad_norm = self.train_step()
            compiled = clock.count_step()
            if compiled is not None:
                self.log.note(f"step {state.step}: compiled in {compiled:.1f} s (this first step included); "
                              f"tokens/s count the steps after it")
            # a signal any rank received: all stop after the same step (the loss is already averaged)
            stop_signal = self.world.stop_requested(stop.received)
            self.log.advance()
            if self.step_skipped:
                check_bad_steps(state, self.scaler, self.cfg.train.max_bad_steps, self.run_dir,
                                loss_sum.item(), grad_norm.item())
            else:
                state.bad_in_a_row = 0
                window_loss += loss_sum.double()
                window["good_steps"] += 1
            last = state.step == t.max_steps
            logging, saving = self._due(t.log_interval) or last, self._due(t.checkpoint_interval) or last
            if logging or saving or stop.received is not None:
                window["loss_sum"] = window_loss.item()  # the sync: the window's steps are done
            if logging:
                self._log_window(clock, grad_norm)
                window_loss.zero_()
            if (self._due(t.eval_interval) or last) and clock.paused(self._evaluate):
                if not logging:  # the target ends the run here: its window logged and saved as the last step's
                    window["loss_sum"] = window_loss.item()
                    self._log_window(clock, grad_norm)
                saving = True
            saved = clock.paused(self.save) if saving else None
            if stop_signal is not None:
                raise Stopped(stop_signal, state.step, saved or self.save())
        state.history["train_loss"] = window["last_loss"]

    def _due(self, interval: int) -> bool:
        """Whether a step of `interval` (0: never) ends here."""
        return bool(interval) and self.state.step % interval == 0

    def _log_window(self, clock: WindowClock, grad_norm: torch.Tensor) -> None:
        """The record of the logging window that ends here; then the next window starts."""
        steps_per_second = clock.end_window()
        self.log.record(training_record(self.measurements, grad_norm.item(), self.optimizer.param_groups[0]["lr"],
                                        steps_per_second), steps_per_second)
        self.state.window.update(loss_sum=0.0, good_steps=0, lost_updates=[0, 0])
        clock.restart()

    def _evaluate(self) -> bool:
        """The validation loss (train/evaluate.py), logged and kept in the history. Returns whether
        it reached train.target_loss (then kept in the history as TARGET_REACHED: the run ends)."""
        t = self.cfg.train
        seed = t.seed + 1 if t.eval_seed is None else t.eval_seed
        val_loss = evaluate(self.model, self.data.val, t.batch_size, self.cfg.seq_len, seed, t.eval_batches,
                            self.device, self.policy, self.world, self.make_batch, engine=self.engine)
        self.state.history["val_loss"] = val_loss
        self.log.record({"step": self.step, "val_loss": val_loss, "time": time.time()})
        self.log.note(f"step {self.step}: val loss {val_loss:.4f}")
        target = t.target_loss
        if target is None or val_loss > target:
            return False
        self.state.history[TARGET_REACHED] = {"step": self.step, "target_loss": target}
        self.log.note(f"step {self.step}: target reached (val loss {val_loss:.4f} <= train.target_loss={target:g})")
        return True
