"""The run's metrics for the tools people already use: TensorBoard, and Weights & Biases on request.

`Trackers` takes the same records the trainer writes to metrics.jsonl ({"step": 100, "train_loss":
..., "lr": ..., ...}) and writes each number as a scalar under its metrics.jsonl name, so the two
records always agree. TensorBoard event files go into the run folder itself: `tensorboard --logdir
runs` shows every run side by side. W&B is optional (never a dependency); it honours WANDB_MODE,
so `WANDB_MODE=offline` works without a network and `wandb sync` uploads later.
"""

from pathlib import Path

from lmforge.common.errors import LmforgeError

# Fields of a record that are not curves: the x-axis, and the wall-clock time of the record.
NOT_SCALARS = ("step", "time")


class Trackers:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: bool = False,
                 config: dict | None = None, resume_step: int | None = None):
        """`resume_step`: the checkpoint's step when a run resumes. What an interrupted session logged
        after it is redone, so TensorBoard is told to drop those points (as MetricsLog drops its lines)."""
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
