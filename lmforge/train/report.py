"""What a run reports while it trains: metrics.jsonl, TensorBoard (and W&B), the progress bar.

Each record (a dict with its `step`) goes to all of them at once, so they always agree. The
progress bar reads like torchtitan's metrics line: loss, learning rate, gradient norm, tokens/s,
MFU, memory, then tqdm's ETA; with --no-progress (batch jobs, CI logs) the same fields are printed
as one plain line per record instead.
"""

import json
import time
from pathlib import Path

from rich.console import Console
from tqdm import tqdm

from lmforge.config import Config, config_to_dict
from lmforge.common.errors import LmforgeError, format_duration, human_bytes
from lmforge.common.folders import write_file_staged
from lmforge.accounting.measure import peak_memory_bytes
from lmforge.train.measurements import RunMeasurements


def format_mfu(mfu: float) -> str:
    """MFU as a percentage; "-" when it rounds to nothing (a model too small to measure it by)."""
    if mfu < 0.0005:
        return "-"
    return f"{mfu:.0%}" if mfu >= 0.1 else f"{mfu:.1%}"


def metrics_line(record: dict) -> str:
    """The fields of a training record, in torchtitan's order: loss, lr, grad norm, tokens/s, MFU,
    memory (and HFU, loss scale where the run has them)."""
    parts = [f"loss {record['train_loss']:.4f}" if record.get("train_loss") is not None else "loss -",
             f"lr {record['lr']:.2e}", f"grad {record['grad_norm']:.3g}",
             f"{record['tokens_per_s']:,.0f} tok/s", f"MFU {format_mfu(record['mfu'])}"]
    if "hfu" in record:
        parts.append(f"HFU {format_mfu(record['hfu'])}")
    parts.append(f"mem {human_bytes(record['peak_memory_bytes'])}")
    if "loss_scale" in record:
        parts.append(f"scale {record['loss_scale']:g}")
    return " | ".join(parts)


class StepLog:
    """Where the loop's records go. `keep` (on resume): the metrics.jsonl lines to keep (the records
    up to the checkpoint's step, runs/metrics.py lines_to_keep); the trackers drop what an
    interrupted session logged after `start_step` too."""

    def __init__(self, run_dir: Path, cfg: Config, console: Console, progress: bool, start_step: int,
                 keep: list[str] | None):
        self.console, self.progress, self.max_steps = console, progress, cfg.train.max_steps
        self.metrics_path = run_dir / "metrics.jsonl"  # append-only JSON lines, one record per log or evaluation
        if keep is not None and self.metrics_path.exists():  # rewritten first: it reads as one uninterrupted run
            write_file_staged(self.metrics_path, lambda path: path.write_text("".join(line + "\n" for line in keep)))
        self.metrics = open(self.metrics_path, "a")
        self.trackers = Trackers(run_dir, tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb,
                                 config=config_to_dict(cfg), resume_step=start_step if keep is not None else None)
        self.bar = tqdm(total=self.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not progress, bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {postfix} | "
                                                         "ETA {remaining}")

    def advance(self) -> None:
        self.bar.update(1)

    def record(self, record: dict, steps_per_second: float | None = None) -> None:
        """Log a record everywhere; a training record also updates the bar (or prints its line)."""
        try:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        except OSError as err:  # a write to an open file does not name it: add the path
            raise OSError(err.errno, err.strerror, str(self.metrics_path)) from err
        self.trackers.write(record)
        if "train_loss" not in record:
            return
        line = metrics_line(record)
        if self.progress:
            self.bar.set_postfix_str(line)
        else:
            eta = (self.max_steps - record["step"]) / steps_per_second if steps_per_second else None
            self.console.print(f"step {record['step']}/{self.max_steps} | {line}"
                               + (f" | ETA {format_duration(eta)}" if eta is not None else ""),
                               highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """A line between bar updates (an evaluation's result)."""
        if self.progress:
            self.bar.write(text)
        else:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        self.bar.close()
        try:
            self.metrics.close()
        except OSError:
            pass  # the buffered rest could not be flushed (full disk): the write that failed said so
        self.trackers.close()


class SilentLog:
    """Where the records of ranks other than 0 go: nowhere (rank 0 logs for the run)."""

    def advance(self) -> None:
        pass

    def record(self, record: dict, steps_per_second: float | None = None) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def training_record(run: RunMeasurements, grad_norm: float, lr: float, steps_per_second: float) -> dict:
    """The metrics record of the logging window that ends at the run's current step (and the
    window's mean loss, kept in its run state)."""
    state, window = run.state, run.state.window
    if window["good_steps"]:  # mean over the window's good steps: less noisy than one step's
        window["last_loss"] = window["loss_sum"] / window["good_steps"]
    tokens_per_s = steps_per_second * run.tokens_per_step
    record = {"step": state.step, "train_loss": window["last_loss"], "grad_norm": grad_norm, "lr": lr,
              "tokens_per_s": tokens_per_s, "mfu": run.mfu(tokens_per_s),
              "tokens_seen": state.tokens_trained, "skipped_steps": state.skipped_steps,
              "time": time.time(), "elapsed_s": time.time() - run.started,
              "peak_memory_bytes": peak_memory_bytes(run.device)}
    if run.hardware_flops_per_token is not None:  # hardware FLOPs include the recomputed forward
        record["hfu"] = run.hfu(tokens_per_s)
    if run.loss_scale is not None:
        record["loss_scale"] = run.loss_scale
    if run.lost_updates is not None:
        lost, updated = window["lost_updates"]
        record["lost_update_fraction"] = lost / updated if updated else 0.0
    return record


# The run's metrics for the tools people already use: TensorBoard, and Weights & Biases on request.
#
# `Trackers` takes the same records the trainer writes to metrics.jsonl ({"step": 100, "train_loss":
# ..., "lr": ..., ...}) and writes each number as a scalar under its metrics.jsonl name, so the two
# records always agree. TensorBoard event files go into the run folder itself: `tensorboard --logdir
# runs` shows every run side by side. W&B is optional (never a dependency); it honours WANDB_MODE,
# so `WANDB_MODE=offline` works without a network and `wandb sync` uploads later.
# Fields of a record that are not curves: the x-axis, and the wall-clock time of the record.
NOT_SCALARS = ("step", "time")


class Trackers:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: bool = False,
                 config: dict | None = None, resume_step: int | None = None):
        """`resume_step`: the checkpoint's step when a run resumes. What an interrupted session logged
        after it is redone, so TensorBoard is told to drop those points (as StepLog drops its metrics.jsonl lines)."""
        self.run_dir = Path(run_dir)
        self._wandb = None
        if wandb:  # checked first, so that a missing package stops the run before anything is written
            try:
                import wandb as wandb_module
            except ImportError:
                raise LmforgeError("train.wandb=true but the wandb package is not installed: pip install wandb, "
                                   "or set train.wandb=false") from None
            # one W&B run per session, named after the run folder (a resumed run shows as a second one)
            self._wandb = wandb_module.init(project="lmforge", name=self.run_dir.name, dir=str(self.run_dir),
                                            config=config)
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge_step = resume_step + 1 if resume_step is not None else None
            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        """Log every number of a record at its step (text, booleans and missing values are left out)."""
        step = record["step"]
        scalars = {key: float(value) for key, value in record.items()
                   if key not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step, walltime=record.get("time"))
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
