"""The training loop: data -> model -> AdamW, with evaluation, checkpoints and logs.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows of `seq_len` tokens; each
micro-batch loss is divided by grad_accum so that the summed gradient equals the gradient of the
mean loss over the whole batch. Then: clip the global gradient norm, set the scheduled learning
rate, AdamW step. Cost figures (FLOPs per token, peak FLOP/s, MFU) come from `accounting/`.

Under torchrun every rank runs this loop in lockstep (forward, backward, evaluation, checkpoints:
a sharded model needs every rank in every forward); `train.batch_size` is per rank, and rank 0
alone prints, logs and writes reports. The loss logged is the mean over the ranks, and tokens/s,
the global batch and MFU count all of them (lmforge/parallel/world.py).

A run is read in this order: train/setup.py builds the model and optimizer, this file trains,
train/state.py keeps the run folder and its checkpoints, train/report.py logs each record and
train/summary.py writes the end of the run.
"""

import functools
import math
import os
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console

from lmforge.accounting.flops import hardware_flops_per_token, training_flops_per_token
from lmforge.accounting.hardware import this_device
from lmforge.accounting.plan.make import Setup, make_plan, matmul_dtype
from lmforge.config import Config, config_to_dict, config_warnings, load_config
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.data.prepare import PreparedData, prepare_data
from lmforge.common.errors import LmforgeError, warn
from lmforge.model.transformer import Transformer
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.parallel.world import World, init_world, is_collective_failure
from lmforge.modes.parallel import get_strategy
from lmforge.accounting.plan.show import print_plan
from lmforge.parallel.parallelize import Engine
from lmforge.parallel.pipeline.timeline import Timeline
from lmforge.precision.loss_scaler import LossScaler
from lmforge.precision.policy import autocast, device_notes
from lmforge.modes.precision import get_policy
from lmforge.precision.policy import fp8_scale_state, load_fp8_scale_state
from lmforge.runs.checkpoint.find import kept_checkpoint
from lmforge.parallel.pipeline.report import pipeline_report
from lmforge.train.report import SilentLog, StepLog, training_record
from lmforge.runs.load import check_same_base
from lmforge.train.finetune import prepare_finetune
from lmforge.train.setup import build_engine, check_attention, check_data
from lmforge.train.signals import StopRequests, Stopped
from lmforge.runs.state import RunFolder, RunState
from lmforge.train.summary import FirstStepMeasurement, write_summary

# Under fp16-mixed a step with inf/NaN gradients is skipped and the loss scale halved: normal at
# the start of a run and now and then later. This many skips in a row (the scale fell 2**64-fold)
# mean no scale helps: the forward pass itself overflows fp16.
FP16_MAX_SKIPS_IN_A_ROW = 64


@torch.no_grad()
def evaluate(model: Transformer, tokens, batch_size: int, seq_len: int, seed: int, batches: int,
             device: torch.device, precision: str = "fp32", world: World = World(),
             make_batch=window_batch, engine: Engine | None = None) -> float:
    """Mean loss over a fixed set of `batches` batches (the same ones at every evaluation),
    computed as training computes it (under the forward autocast of `precision`); `make_batch`
    draws them (windows, or fine-tuning examples: data/sft.py's example_batch). Each replica takes
    its rows of the global batches and the means are averaged over the ranks: N ranks of
    batch_size B evaluate what one process of N*B does. With an `engine`, its `eval_loss` runs the
    forward (a pipeline's goes through every stage) and its replicas share the batches."""
    was_training = model.training
    model.eval()
    losses = []
    replica, replicas = (engine.replica, engine.replicas) if engine is not None else (world.rank, world.world_size)
    loss_of = engine.eval_loss if engine is not None else model
    for index in range(batches):
        x, y = make_batch(tokens, batch_size, seq_len, seed, index, rank=replica, world_size=replicas)
        with autocast(get_policy(precision), device):
            losses.append(loss_of(x.to(device), y.to(device)).item())
    model.train(was_training)
    return world.mean(sum(losses) / len(losses))


def train_step(engine: Engine, next_batch, grad_accum: int, lr: float, grad_clip: float, scaler: LossScaler,
               policy, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step of any data-parallel engine (lmforge/parallel/): `grad_accum` micro-batches
    from `next_batch()`, communicating only in the last one's backward; then unscale (fp16) and clip
    the global gradient norm, and the AdamW step at `lr` unless the loss or the gradients are not
    finite. Returns (loss of the step averaged over ranks, gradient norm before clipping, skipped).

    Each micro-batch loss is divided by grad_accum, so that the summed gradient is the gradient of
    the mean loss over the batch; the engine averages it over the ranks."""
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

    `world`: this process's place under torchrun; by default read from the environment (and the
    process group joined), a single process outside torchrun."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
                 progress: bool = True, machine=functools.partial(this_device, store=False),
                 world: World | None = None):
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
        # rank 0 prepares the data (once, under the data folder's lock); the others then open it
        if cfg.finetune.base is None:
            self.data: PreparedData = self.world.main_first(
                lambda: prepare_data(cfg, log=self.console.print, progress=self.progress))
            check_data(cfg, self.data, warn=lambda msg: self.console.print(f"warning: {msg}"))
            self.base_state = self.base_identity = None
        else:  # fine-tuning: the base's weights and tokenizer (train/finetune.py)
            self.data, self.base_state, self.base_identity = self.world.main_first(
                lambda: prepare_finetune(cfg, log=self.console.print))
        # the run folder is locked (by rank 0) from here on: a second writer is refused before the model is built
        self.folder = self.world.main_first(
            lambda: RunFolder(self.run_dir, warn=lambda msg: self.console.print(f"warning: {msg}"), world=self.world))
        try:
            self._setup(resume, machine)
        except BaseException:
            self.close()
            raise
        print_plan(self.console, self.plan, title="lmforge train: plan")

    def _setup(self, resume: bool, machine) -> None:
        cfg = self.cfg
        checkpoint = self.world.from_main(self.folder.latest_checkpoint if resume else self.folder.check_new)
        # what checkpoints hold besides tensors: from memory, not re-read from the run folder
        self.config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        self.tokenizer_json = self.data.tokenizer.to_str(pretty=True)
        self.policy = get_policy(cfg.train.precision)
        for note in device_notes(self.policy, self.device):
            self.console.print(f"note: {note}")
        # the model and everything that wraps it (precision, recomputation, LoRA, parallelism), then the optimizer
        self.timeline = Timeline() if cfg.train.pipeline_stages > 1 else None  # what each pipeline step did, when
        self.engine = build_engine(cfg, self.device, self.base_state, timeline=self.timeline)
        self.model, self.optimizer = self.engine.model, self.engine.optimizer
        # sequences per optimizer step: every replica's micro-batches
        self.global_batch = (cfg.train.batch_size * self.engine.replicas * cfg.train.grad_accum
                             * cfg.train.micro_batches)
        self.base_state = None  # copied into the model: let it go
        self.scaler = LossScaler(enabled=self.policy.loss_scaling)
        self.lost_updates_total = [0, 0]  # this session: elements whose update rounded away, elements updated
        self.state, metrics_kept = RunState(), None
        if resume:
            self.state, metrics_kept = self._restore(*checkpoint)
        world, engine = self.world, self.engine
        # each replica of the model draws its rows of the global batch (every stage of a pipeline the same)
        self.loader = BatchLoader(self.data.train, cfg.train.batch_size, cfg.seq_len, seed=cfg.train.seed,
                                  start=self.state.loader_position, prefetch=cfg.data.prefetch, device=self.device,
                                  rank=engine.replica, world_size=engine.replicas,
                                  make_batch=getattr(self.data, "batches", window_batch))
        self.tokens_per_step = self.global_batch * cfg.seq_len
        self.parameters = engine.num_params()  # of the whole model, all stages
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.seq_len)
        self.hardware_flops_per_token = hardware_flops_per_token(cfg.model, cfg.seq_len, cfg.train.recompute)
        self.peak_dtype = matmul_dtype(cfg.train.precision)
        machine = world.from_main(lambda: machine(self.peak_dtype, self.device))  # measured once, by rank 0
        # CPU ranks on one machine whose threads outnumber its cores share them (the peak was
        # measured with this process's threads alone): each rank has its share of that peak
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        sharing = max(1.0, local_ranks * torch.get_num_threads() / (os.cpu_count() or 1))
        if self.device.type == "cpu" and sharing > 1:
            name, peak, memory = machine
            machine = (f"{name} (shared by {local_ranks} ranks)", peak / sharing, memory / local_ranks)
        self.device_label, self.peak_flops, _ = machine  # of one rank's device
        self.world_peak_flops = self.peak_flops * world.world_size  # what MFU divides by: every rank's device
        # The plan, at 100% MFU: its time is a lower bound and measured/predicted throughput is the MFU.
        setup = Setup.from_config(cfg, mfu=1.0, dp=engine.replicas,
                                  zero_stage=get_strategy(cfg.train.parallel).zero_stage)
        self.plan = make_plan(cfg.model, setup, machine)
        # every check has passed: only now is anything in the run folder written, by rank 0 alone
        if world.is_main:
            self.folder.write_start(self.config_yaml, self.tokenizer_json)
            self.log = StepLog(self.run_dir, cfg, self.console, self.progress, self.state.step, keep=metrics_kept)
        else:
            self.log = SilentLog()

    # -- checkpoints ------------------------------------------------------------------------------

    def _restore(self, path: Path, state: dict) -> tuple[RunState, list[str]]:
        """Load checkpoint `path` once it is checked to fit this run; reads only."""
        check_same_base(state.get("base"), self.base_identity, path)
        run, metrics_kept = self.folder.restore(path, state, self.engine, self.cfg,
                                                self.policy.name, self.data)
        precision = state["precision"]
        if "loss_scaler" in precision:
            self.scaler.load_state_dict(precision["loss_scaler"])
        load_fp8_scale_state(self.model, precision.get("fp8_scales", {}))
        saved_config = load_config(path / "config.yaml").train
        saved_batch = state.get("global_batch", state.get("world_size", 1) * saved_config.batch_size * saved_config.grad_accum)
        if saved_batch != self.global_batch:
            self.console.print(f"note: the global batch changes from {saved_batch} to {self.global_batch} sequences per "
                               f"step; to continue the same training keep train.batch_size x grad_accum x "
                               f"micro_batches x replicas = {saved_batch}", soft_wrap=True)
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
            precision["fp8_scales"] = self.engine.merged_over_stages(fp8_scale_state(self.model))
        self.state.loader_position = self.loader.position
        extra = {"tokenizer_sha256": self.data.meta["tokenizer_sha256"], "precision": precision,
                 "global_batch": self.global_batch}
        if self.base_identity is not None:
            extra["base"] = self.base_identity  # a LoRA checkpoint holds only the adapters: which base they fit
        return self.folder.save(self.state, self.engine, extra,
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
        loss_sum, grad_norm, self.step_skipped = train_step(
            self.engine, lambda: next(self.loader), cfg.train.grad_accum, Schedule.of(cfg)(state.step),
            cfg.optim.grad_clip, self.scaler, self.policy, self.device)
        if not self.step_skipped:
            if self.optimizer.count_lost_updates:
                for counts in (state.window["lost_updates"], self.lost_updates_total):
                    counts[0] += self.optimizer.lost_updates
                    counts[1] += self.optimizer.updated_elements
        else:
            state.skipped_steps += 1
        state.step += 1
        return loss_sum, grad_norm

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate(self.model, self.data.val, t.batch_size, self.cfg.seq_len, t.seed + 1,
                        t.eval_batches, self.device, t.precision, self.world,
                        getattr(self.data, "batches", window_batch), engine=self.engine)

    def run(self) -> dict:
        """Train to train.max_steps, then write the summary. SIGTERM or Ctrl-C: finish the step,
        save a checkpoint and raise `Stopped`. The run folder's lock is released on return."""
        start_step = self.session_start_step = self.step
        self.measured = FirstStepMeasurement(self.engine, self.device)
        try:
            with StopRequests() as stop:
                train_seconds = self._loop(stop)
            if self.timeline is not None:
                self.pipeline = pipeline_report(self)
            return write_summary(self, start_step, train_seconds)
        except Exception as err:
            if self.world.world_size > 1 and is_collective_failure(err):  # a rank died or hangs
                raise self.world.failure(err) from None
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Stop the loader, close the logs, remove the measuring hooks, release the folder."""
        for part in ("loader", "log", "measured"):  # whichever setup got to build
            if hasattr(self, part):
                getattr(self, part).close()
        self.folder.release()

    def _loop(self, stop: StopRequests) -> float:
        """The steps; returns the seconds they took (without the compile, see below).

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
        session_start = time.time()
        train_seconds, window_steps = 0.0, 0  # timing: this session only
        # with train.compile, the session's first step compiles: timed apart as compile_seconds
        self.compile_seconds = None
        window_loss = torch.tensor(window["loss_sum"], dtype=torch.float64, device=self.device)
        window_started = time.perf_counter()
        while state.step < t.max_steps:
            loss_sum, grad_norm = self.train_step()
            if t.compile and self.compile_seconds is None:
                self._synchronize()
                self.compile_seconds = time.perf_counter() - window_started
                self.log.note(f"step {state.step}: compiled in {self.compile_seconds:.1f} s (this first step "
                              f"included); tokens/s count the steps after it")
                window_started = time.perf_counter()
            else:
                window_steps += 1
            # a signal any rank received: all stop after the same step (the loss is already averaged)
            stop_signal = self.world.stop_requested(stop.received)
            self.log.advance()
            if self.step_skipped:
                self._guard(loss_sum.item(), grad_norm.item())
            else:
                state.bad_in_a_row = 0
                window_loss += loss_sum.double()
                window["good_steps"] += 1
            last = state.step == t.max_steps
            saving = (t.checkpoint_interval and state.step % t.checkpoint_interval == 0) or last \
                or stop.received is not None
            if state.step % t.log_interval == 0 or last or saving:
                window["loss_sum"] = window_loss.item()  # the sync: the window's steps are done
            if state.step % t.log_interval == 0 or last:
                window_seconds = time.perf_counter() - window_started
                train_seconds += window_seconds
                steps_per_second = window_steps / window_seconds if window_steps else 0.0
                self.log.record(training_record(self, grad_norm.item(), steps_per_second, session_start),
                                steps_per_second)
                window.update(loss_sum=0.0, good_steps=0, lost_updates=[0, 0])
                window_loss.zero_()
                window_started, window_steps = time.perf_counter(), 0
            if (t.eval_interval and state.step % t.eval_interval == 0) or last:
                eval_started = time.perf_counter()
                val_loss = self.evaluate()
                state.history["val_loss"] = val_loss
                self.log.record({"step": state.step, "val_loss": val_loss, "time": time.time()})
                self.log.note(f"step {state.step}: val loss {val_loss:.4f}")
                window_started += time.perf_counter() - eval_started  # evaluation is not training time
            saved = None
            if (t.checkpoint_interval and state.step % t.checkpoint_interval == 0) or last:
                save_started = time.perf_counter()
                saved = self.save()
                window_started += time.perf_counter() - save_started
            if stop_signal is not None:
                raise Stopped(stop_signal, state.step, saved or self.save())
        state.history["train_loss"] = window["last_loss"]
        return train_seconds

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _guard(self, loss: float, grad_norm: float) -> None:
        """After a bad (skipped) step: stop the run when they keep coming; before this step is
        checkpointed, so the last checkpoint on disk is a good one."""
        state = self.state
        state.bad_in_a_row += 1
        if self.scaler.enabled:
            if state.bad_in_a_row >= FP16_MAX_SKIPS_IN_A_ROW:
                raise LmforgeError(f"{state.bad_in_a_row} steps in a row had inf/NaN gradients up to step "
                                   f"{state.step} (loss scale now {self.scaler.scale_value:g}): fp16 overflows in "
                                   f"the forward pass; " + kept_checkpoint(
                                       self.run_dir, "use bf16-mixed or lower optim.lr"))
        elif state.bad_in_a_row >= self.cfg.train.max_bad_steps:
            what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
            raise LmforgeError(f"{what} at step {state.step}; " + kept_checkpoint(
                self.run_dir, f"lower optim.lr or raise optim.warmup_steps (train.max_bad_steps="
                              f"{self.cfg.train.max_bad_steps} bad steps in a row allowed)"))
