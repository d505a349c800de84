"""The training loop: data -> model -> AdamW, with evaluation, checkpoints and logs. Each step is
train/step.py's; cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.

Under torchrun every rank runs this loop in lockstep (forward, backward, evaluation, checkpoints:
a sharded model needs every rank in every forward); `train.batch_size` is per rank, and rank 0
alone prints, logs and writes reports. The loss logged is the mean over the ranks, and tokens/s,
the global batch and MFU count all of them (lmforge/parallel/world.py).

Read in this order: train/setup.py builds the model and optimizer, this file trains, runs/state.py
keeps the folder and its checkpoints, train/measurements.py measures, train/report.py logs each
record and train/summary.py writes the end of the run.
"""

import functools
import time
from pathlib import Path

import torch
from rich.console import Console

from lmforge.accounting.hardware import this_device
from lmforge.accounting.plan.make import matmul_dtype
from lmforge.accounting.plan.show import print_plan
from lmforge.common.errors import warn
from lmforge.config import Config, config_warnings
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.modes import get_policy
from lmforge.optim.schedule import Schedule
from lmforge.parallel.parallelize import Engine
from lmforge.parallel.pipeline.timeline import Timeline, pipeline_report
from lmforge.parallel.faults import is_collective_failure
from lmforge.parallel.world import World, init_world
from lmforge.precision.policy import LossScaler, device_notes
from lmforge.runs.state import TARGET_REACHED, Checkpoints, RunFolder, RunState
from lmforge.train.evaluate import EvalTasks, run_evaluation
from lmforge.train.guard import check_bad_steps
from lmforge.train.measurements import (FirstStepMeasurement, TrafficMeter, WindowClock, estimate, rank_share,
                                        run_plan, start_measurements)
from lmforge.train.report import SilentLog, StepLog, training_record
from lmforge.train.setup import build_engine, check_attention, check_memory, prepare_run_data
from lmforge.train.signals import StopRequests, Stopped
from lmforge.train.step import train_step
from lmforge.train.summary import write_summary


class Trainer:
    """One training run in its folder. Setup locks the folder, then checks everything (data, model,
    checkpoint, metrics) before it writes anything; the lock is held until `run()` returns.

    `machine(matmul_dtype, device)` gives (name, peak FLOP/s, memory bytes) of the device for MFU
    and the plan, once the checks have passed; by default accounting.hardware.this_device, reading
    the measured peak from the cache `lmforge` keeps but never writing to it (the CLI does). The
    plan is closed-form accounting; no estimator or report can stop the run (measurements.estimate).
    `world`: this process's place under torchrun; by default read from the environment (and the
    process group joined), a single process outside torchrun."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
                 progress: bool = True, machine=functools.partial(this_device, store=False),
                 world: World | None = None):
        self.world = world if world is not None else init_world(cfg)  # a launch that cannot work stops here
        with self.world.setup_faults():  # a rank lost before the first step: one line, as in run()
            self._start(cfg, run_dir, resume, console, progress, machine)

    def _start(self, cfg: Config, run_dir: Path, resume: bool, console: Console | None, progress: bool,
               machine) -> None:
        """Lock and check the folder, prepare the data, build, restore and measure (see the class docstring)."""
        main = self.world.is_main
        # rank 0's folder for all (a default name holds the time, which the ranks may read a second apart)
        self.cfg, self.run_dir = cfg, Path(self.world.from_main(lambda: str(run_dir)))
        self.console = (console or Console()) if main else Console(quiet=True)
        self.progress = progress and main
        self.device = self.world.device
        check_attention(cfg.model, self.device)
        self.eval_tasks = EvalTasks(cfg) if cfg.train.eval_tasks.strip(" ,") else None  # a bad name stops here
        torch.manual_seed(cfg.train.seed)  # the same on every rank: the same initial model
        self.policy = get_policy(cfg.train.precision)
        # locked by rank 0 from here on; the folder and a resume's checkpoint are checked before the data is prepared
        self.folder = self.world.main_first(
            lambda: RunFolder(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"), world=self.world))
        try:
            checkpoint = self.world.from_main(lambda: self.folder.latest_checkpoint(cfg, self.policy.name) if resume
                                              else self.folder.check_new())
            for message in config_warnings(cfg) if main else ():  # the config's, once it is known to be the run's
                warn(message)
            self.data, self.base_state, self.base_identity = prepare_run_data(
                cfg, self.world, checkpoint and checkpoint[1], log=lambda msg: self.console.print(msg, soft_wrap=True),
                warn=lambda msg: self.console.print(f"warning: {msg}"), progress=self.progress)
            self._setup(checkpoint, machine)
        except BaseException:
            self.close()
            raise
        if self.plan is not None:  # the plan's failure was its one warning line
            self._estimate("printing the plan", lambda: print_plan(self.console, self.plan, "lmforge train: plan"))

    def _estimate(self, what: str, fn):  # an estimator's or report's failure: one line (rank 0's), and None
        return estimate(what, fn, warn if self.world.is_main else lambda message: None)

    def _setup(self, checkpoint: tuple | None, machine) -> None:
        """Build, restore a resume's checkpoint (path, state) and measure, checking as it goes; then the first files."""
        cfg, resume = self.cfg, checkpoint is not None
        engine = self._build()
        self.checkpoints = Checkpoints(self.folder, cfg, self.data, engine, self.policy, self.scaler,
                                       self.base_identity, self.global_batch)
        self.state, metrics_kept = (self.checkpoints.restore(*checkpoint, self.console) if resume
                                    else (RunState(), None))
        self.saved = checkpoint[0] if resume else None  # the newest checkpoint (save() keeps it)
        self._measure(machine)
        if self.plan is not None:
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
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        self.timeline = Timeline() if cfg.parallel.pp > 1 else None  # what each pipeline step did, when
        self.engine = build_engine(cfg, self.policy, self.device, self.base_state, timeline=self.timeline)
        self.model, self.optimizer = self.engine.model, self.engine.optimizer
        self.traffic = TrafficMeter(self.engine)
        self.base_state = None  # copied into the model: let it go
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        # sequences per optimizer step: every replica's micro-batches
        self.global_batch = (cfg.train.batch_size * self.engine.replicas * cfg.train.grad_accum
                             * cfg.train.micro_batches)
        return self.engine

    def _measure(self, machine) -> None:
        """The run's measurements record (train/measurements.py) and the plan to set them beside."""
        cfg, engine = self.cfg, self.engine
        # measured by rank 0; each rank has its share
        peak = self.world.measured_on_main(lambda: machine(matmul_dtype(cfg.train.precision), self.device),
                                           "measure this machine's matmul peak")
        machine = rank_share(peak, self.device)
        self.measurements = start_measurements(
            cfg, engine, self.world, self.state, self.policy.name,
            loss_scale=self.scaler.scale_value if self.scaler.enabled else None,
            tokens_per_step=self.global_batch * cfg.seq_len, peak_flops=machine[1])
        self.plan = run_plan(cfg, engine.replicas, machine, self.global_batch, self._estimate)

    def save(self) -> Path:
        self.state.loader_position = self.loader.position
        self.saved = self.checkpoints.save(self.state)
        return self.saved

    def _check_stop(self, stop: StopRequests) -> None:
        """After the last save (the sample): a stop request any rank received ends the run here."""
        if stop.agreed_by(self.world) is not None:
            raise Stopped(stop.agreed, self.step, self.saved)

    # the loop's counters live in the run state (they are checkpointed); read them by these names
    step = property(lambda self: self.state.step)
    skipped_steps = property(lambda self: self.state.skipped_steps)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the batch, gradient norm before clipping).

        A step whose loss or gradients are not finite is skipped (no update) and `step_skipped`
        set: under fp16-mixed the loss scaler also lowers the scale; the caller decides when too
        many bad steps stop the run."""
        cfg, state, run = self.cfg, self.state, self.measurements
        sent_before = self.traffic.sent()  # training's traffic only: evaluation sends too
        loss_sum, grad_norm, self.step_skipped = train_step(
            self.engine, lambda: next(self.loader), cfg.train.grad_accum, Schedule.of(cfg)(state.step),
            cfg.optim.grad_clip, self.scaler, self.policy, self.device)
        self.traffic.add_step(run, sent_before)
        if self.step_skipped:
            state.skipped_steps += 1
        elif run.lost_updates is not None:
            for counts in (state.window["lost_updates"], run.lost_updates):
                counts[0] += self.optimizer.lost_updates
                counts[1] += self.optimizer.updated_elements
        if self.scaler.enabled:
            run.loss_scale = self.scaler.scale_value
        state.step += 1
        state.tokens_trained += run.tokens_per_step  # this session's global batch (a resume may change it)
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
                run.data_wait_seconds, run.sent_bytes = self.loader.wait_seconds, self.traffic.data_parallel()
                if self.timeline is not None:
                    run.pipeline = pipeline_report(self.engine, self.timeline.events, self.cfg, run.first_step,
                                                   self.step, self.run_dir, self.world.is_main)
                if self.cfg.train.roofline and self.plan is not None and self.world.is_main:
                    from lmforge.train.roofline import add_roofline  # after the last checkpoint is written

                    add_roofline(self.plan, self.cfg, self.engine.replicas, self.device, self._estimate)
                return write_summary(run, self.cfg, self.plan, self.data, self.model, self.run_dir, self.console,
                                     self.world.is_main, self._estimate, check_stop=lambda: self._check_stop(stop))
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
        that in time); the guard that stops a run after bad steps reads the loss only then."""
        t, state, window = self.cfg.train, self.state, self.state.window
        if state.step and self._due(t.eval_interval):  # resumed where a stop may have cut an evaluation short
            self._evaluate_owed(stop)
        self.model.train()
        self.measurements.started = time.time()
        clock = WindowClock(self.measurements, compiling=t.compile)
        window_loss = torch.tensor(window["loss_sum"], dtype=torch.float64, device=self.device)
        # a run that reached train.target_loss (runs/state.py's Checkpoints lets one resume only to write its summary)
        while state.step < t.max_steps and TARGET_REACHED not in state.history:
            loss_sum, grad_norm = self.train_step()
            compiled = clock.count_step()
            if compiled is not None:
                self.log.note(f"step {state.step}: compiled in {compiled:.1f} s (this first step included); "
                              f"tokens/s count the steps after it")
            # a signal any rank received: all stop after the same step (the loss is already averaged)
            stop.agreed_by(self.world)
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
            if logging or saving or stop.agreed is not None:  # any rank's request: all save this step
                window["loss_sum"] = window_loss.item()  # the sync: the window's steps are done
            if logging:
                self._log_window(clock, grad_norm)
                window_loss.zero_()
            if (self._due(t.eval_interval) or last) and clock.paused(lambda: self._evaluate(stop)):
                if not logging:  # the target ends the run here: its window logged and saved as the last step's
                    window["loss_sum"] = window_loss.item()
                    self._log_window(clock, grad_norm)
                saving = True
            saved = clock.paused(self.save) if saving else None
            if stop.agreed is not None:  # at the step's end, or during its evaluation
                window["loss_sum"] = window_loss.item()
                raise Stopped(stop.agreed, state.step, saved or self.save())
        self._evaluate_owed(stop)  # the final evaluation, if a stop cut it short
        state.history["train_loss"] = window["last_loss"]

    def _evaluate_owed(self, stop: StopRequests) -> None:
        """This step's evaluation again if a stop cut it short (it kept no val_loss), as an uninterrupted run's."""
        if "val_loss" not in self.state.history:
            self._evaluate(stop)
            self._check_stop(stop)

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

    def _evaluate(self, stop: StopRequests) -> bool:  # train/evaluate.py's run_evaluation
        return run_evaluation(self, stopping=lambda: stop.agreed_by(self.world))
