"""What a run measures, as its reports read it.

`RunMeasurements` is the one record the reports get: train/report.py (each metrics record),
train/summary.py (the end of the run) and, as plain values, parallel/pipeline/timeline.py. The
Trainer makes it once the model is built (the rates fixed for the run) and fills in the rest as it
trains; `WindowClock` times its steps.

`FirstStepMeasurement` takes the memory measurements of a session's first optimizer step through
hooks (a forward pre/post hook on the model for the first micro-batch, a step post-hook on the
optimizer), so the training loop itself holds no measuring code; each hook removes itself once it
has run.
"""

import os
import time
from dataclasses import dataclass, field

import torch

from lmforge.accounting.shapes import hardware_flops_per_token, training_flops_per_token
from lmforge.accounting.measure import measure_saved_bytes
from lmforge.accounting.plan.make import Costing, make_plan, matmul_dtype
from lmforge.accounting.scaling import predicted_loss, read_fit
from lmforge.accounting.shapes import model_shapes
from lmforge.common.errors import LmforgeError
from lmforge.config import Config
from lmforge.optim.adamw import counts_lost_updates
from lmforge.parallel.cp_model import ring_traffic
from lmforge.parallel.world import World
from lmforge.runs.state import RunState


@dataclass
class RunMeasurements:
    """What the reports read of a run: the rates fixed at setup, then what the session measures."""

    state: RunState  # the checkpointed counters: step, skipped steps, loss history, the logging window
    device: torch.device
    precision: str  # the policy's name (aliases resolved)
    parameters: int  # of the whole model, all stages
    tokens_per_step: int  # every replica's micro-batches
    flops_per_token: float  # the model's (accounting/shapes.py): what MFU counts
    hardware_flops_per_token: float | None  # the recomputed forward included (HFU); None without recomputation
    peak_dtype: str  # the matmul dtype whose peak was measured
    peak_flops: float  # one rank's device
    world_peak_flops: float  # every rank's device: what MFU divides by
    start_step: int  # the session's first step
    # what the session measures as it trains
    started: float = 0.0  # wall clock at the start of the session's steps
    loss_scale: float | None = None  # fp16-mixed's, after the last step
    lost_updates: list[int] | None = None  # counted (bf16 weights): elements whose update rounded away, updated
    compile_seconds: float | None = None  # train.compile: the session's first step, timed apart
    train_seconds: float = 0.0  # the steps, without evaluation, checkpoints and the compile
    data_wait_seconds: float = 0.0  # of those, waiting for the data loader
    sent_bytes: float | None = None  # by the engine's collectives (None: not counted, as FSDP2's own)
    tp_sent_bytes: float | None = None  # by the tensor-parallel group's, in training steps (None: no tp)
    cp_sent_bytes: float | None = None  # by the context-parallel ring, in training steps (None: no cp)
    first_step: dict = field(default_factory=dict)  # FirstStepMeasurement's bytes
    pipeline: dict | None = None  # a pipeline run's report, measured_by_stage included (parallel/pipeline/timeline.py)

    @property
    def timed_steps(self) -> int:
        """The steps `train_seconds` timed: the session's, the compiling first one left out."""
        return self.state.step - self.start_step - (1 if self.compile_seconds is not None else 0)

    @property
    def tokens_per_s(self) -> float:
        """The session's throughput, over the steps `train_seconds` timed."""
        return self.timed_steps * self.tokens_per_step / self.train_seconds if self.train_seconds else 0.0

    def mfu(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.flops_per_token / self.world_peak_flops

    def hfu(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.hardware_flops_per_token / self.world_peak_flops


def estimate(what: str, fn, warn):
    """`fn()` of an estimator or a report (the plan, the summary's comparison with it, the scaling
    fit's loss, the roofline): an accounting bug must never stop training, so any exception it
    raises is one `warn` line, naming it, and None. Bad input (LmforgeError) still stops with its line."""
    try:
        return fn()
    except LmforgeError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever it is, the run goes on without that figure
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        warn(f"{what} failed ({type(err).__name__}{': ' + first if first else ''}); the run goes on without it")
        return None


def run_plan(cfg: Config, replicas: int, machine: tuple, global_batch: int, estimate) -> dict | None:
    """The plan printed before the first step and set beside the measurements at the end: closed-form
    accounting on `machine` (name, peak FLOP/s, memory bytes), with train.scaling_fit the loss the fit
    predicts for the run's tokens (a bad file stops here, before any write). `estimate(what, fn)`
    runs each estimator (its failure one warning line and None)."""
    costing = Costing(dp=replicas, mfu=1.0, own_steps=True)  # at 100% MFU, the run's own steps timed first
    plan = estimate("the plan", lambda: make_plan(cfg, costing, machine))
    if cfg.train.scaling_fit:
        fit = read_fit(cfg.train.scaling_fit, option="train.scaling_fit")
        tokens = cfg.train.max_steps * global_batch * cfg.seq_len
        scaling = estimate("the scaling fit's predicted loss",
                           lambda: predicted_loss(fit, model_shapes(cfg.model).matmul_weights, tokens))
        if plan is not None and scaling is not None:
            plan["scaling"] = scaling
    return plan


def rank_share(machine: tuple[str, float, int], device: torch.device) -> tuple[str, float, int]:
    """(name, peak FLOP/s, memory bytes) of this rank's share of `machine`: CPU ranks on one machine
    whose threads outnumber its cores share them (the peak was measured with this process's threads
    alone), so each has its share of that peak."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    sharing = max(1.0, local_ranks * torch.get_num_threads() / (os.cpu_count() or 1))
    if device.type != "cpu" or sharing <= 1:
        return machine
    name, peak, memory = machine
    return f"{name} (shared by {local_ranks} ranks)", peak / sharing, memory / local_ranks


def start_measurements(cfg: Config, engine, world: World, state: RunState, precision: str,
                       loss_scale: float | None, tokens_per_step: int, peak_flops: float) -> RunMeasurements:
    """The record of a session about to train `engine` from `state`; `peak_flops`: one rank's."""
    recompute, f = cfg.train.recompute, cfg.finetune
    lora = (f.lora_rank, f.lora_targets) if f.lora_rank is not None else None  # counted as the plan counts it
    return RunMeasurements(
        state=state, device=world.device, precision=precision, parameters=engine.num_params(),
        tokens_per_step=tokens_per_step, flops_per_token=training_flops_per_token(cfg.model, cfg.seq_len, lora=lora),
        hardware_flops_per_token=(hardware_flops_per_token(cfg.model, cfg.seq_len, recompute, lora=lora)
                                  if recompute != "none" else None),
        peak_dtype=matmul_dtype(cfg.train.precision), peak_flops=peak_flops,
        world_peak_flops=peak_flops * world.world_size, start_step=state.step, loss_scale=loss_scale,
        lost_updates=[0, 0] if counts_lost_updates(engine.optimizer) else None)


class TrafficMeter:
    """The bytes tp's collectives and the cp ring send during training steps (evaluation sends
    too): RunMeasurements' tp_sent_bytes and cp_sent_bytes, None where the run has neither; and
    the data-parallel strategy's, where lmforge counts them."""

    def __init__(self, engine):
        self.engine, self.tp = engine, getattr(engine, "tp_comm", None)
        self.ring = ring_traffic(engine.model) if getattr(engine, "cp", 1) > 1 else None

    def data_parallel(self) -> float | None:
        """The bytes the strategy's own collectives sent (None: not counted, e.g. FSDP2's)."""
        comm = self.engine.comm
        return comm.sent_bytes() if comm is not None and self.engine.counts_model_traffic else None

    def sent(self) -> tuple[float, float]:
        return (self.tp.sent_bytes("tp") if self.tp is not None else 0.0,
                sum(self.ring.bytes.values()) if self.ring is not None else 0.0)

    def add_step(self, run: RunMeasurements, before: tuple[float, float]) -> None:
        tp, ring = self.sent()
        if self.tp is not None:
            run.tp_sent_bytes = (run.tp_sent_bytes or 0.0) + tp - before[0]
        if self.ring is not None:
            run.cp_sent_bytes = (run.cp_sent_bytes or 0.0) + ring - before[1]


class FirstStepMeasurement:
    """Fills `into` with the activations saved for backward by the first micro-batch's forward, this
    rank's parameter, gradient and optimizer-state bytes after the first applied step (as the
    data-parallel engine holds them: shards, flat buffers), and on CUDA the peak allocated."""

    def __init__(self, engine, device: torch.device, into: dict):
        self.engine, self.model, self.optimizer, self.device = engine, engine.model, engine.optimizer, device
        self.bytes = into
        self._saving = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._hooks = {"step": self.optimizer.register_step_post_hook(self._after_step)}
        if not engine.measures_activations:  # a pipeline stage measures its micro-batches itself
            self._hooks.update(forward_pre=self.model.register_forward_pre_hook(self._start_forward),
                               forward=self.model.register_forward_hook(self._end_forward))

    def _start_forward(self, module, args):
        if torch.is_grad_enabled():  # a training forward (evaluation runs under no_grad)
            self._saving = measure_saved_bytes(self.model.parameters)
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


class WindowClock:
    """The time of the current logging window's steps, added to `run.train_seconds` as each window
    ends. Evaluation and checkpoints are paused out; with train.compile the session's first step,
    which compiles, is timed apart (`run.compile_seconds`)."""

    def __init__(self, run: RunMeasurements, compiling: bool):
        self.run, self.compiling = run, compiling
        self.started, self.steps = time.perf_counter(), 0

    def count_step(self) -> float | None:
        """Count a finished step; returns the seconds of the compiling first step (the window
        starts after it), None for any other."""
        if self.compiling and self.run.compile_seconds is None:
            if self.run.device.type == "cuda":
                torch.cuda.synchronize(self.run.device)
            self.run.compile_seconds = time.perf_counter() - self.started
            self.started = time.perf_counter()
            return self.run.compile_seconds
        self.steps += 1
        return None

    def paused(self, work):
        """`work()` (an evaluation, a checkpoint), its time left out of the window's."""
        started = time.perf_counter()
        result = work()
        self.started += time.perf_counter() - started
        return result

    def end_window(self) -> float:
        """Steps per second of the window now ending (its time added to the run's); `restart` next."""
        seconds = time.perf_counter() - self.started
        self.run.train_seconds += seconds
        return self.steps / seconds if self.steps else 0.0

    def restart(self) -> None:
        self.started, self.steps = time.perf_counter(), 0
