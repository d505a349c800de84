"""A run's folder and the state that makes it resumable.

    runs/<name>/                 one folder per run, one writer at a time (common/folders.py)
      config.yaml, tokenizer.json   what the run was started (or last resumed) with
      metrics.jsonl                 one record per log or evaluation (train/report.py)
      checkpoints/step_NNNNNNN/     model, optimizer, RNG and `RunState` (runs/checkpoint/)

`RunState` is everything besides tensors that the loop needs to continue exactly: the step, the
tokens trained so far, the logging window (so that a record logged after a resume averages what it would have averaged),
the counts of skipped and bad steps, and the history of losses. `RunFolder` opens a new folder or
restores the newest good checkpoint of an old one; it reads only, until every check has passed.
Under torchrun every rank has a `RunFolder`, but rank 0 alone holds the lock and writes (the
others read checkpoints, and write their part of each one through `torch.distributed.checkpoint`).
"""

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.common.folders import FolderLock
from lmforge.config import Config, lacking_key, load_config, resume_change
from lmforge.parallel.world import World
from lmforge.runs.checkpoint.find import CHECKPOINT_DIR, check_format, find_checkpoint, read_state
from lmforge.runs.checkpoint.read import load_engine_weights, load_optimizer_state, load_rng_states
from lmforge.runs.checkpoint.write import save_checkpoint
from lmforge.common.folders import write_file_staged
from lmforge.runs.metrics import lines_to_keep


@dataclass
class RunState:
    step: int = 0  # optimizer steps taken
    # tokens those steps trained on: a resume may change the global batch, so it is added, not step x batch
    tokens_trained: int = 0
    loader_position: int = 0  # batches handed out by the data loader
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    bad_in_a_row: int = 0  # bad steps since the last good one (the guard stops the run on too many)
    history: dict = field(default_factory=dict)  # latest train and validation loss
    # the logging window: what the next metrics record averages
    window: dict = field(default_factory=lambda: {"loss_sum": 0.0, "good_steps": 0, "lost_updates": [0, 0],
                                                  "last_loss": None})


class RunFolder:
    """The folder of one run, locked (by rank 0) from construction until `release()`."""

    def __init__(self, run_dir: Path, warn, world: World = World()):
        self.path, self.warn, self.world = Path(run_dir), warn, world
        for path in (self.path, *self.path.parents):
            if path.exists() and not path.is_dir():
                raise LmforgeError(f"{path} is a file, not a folder: pick another --out or --name")
        # the lock file lies beside the folder: a parent made for it goes again if the run never writes
        self.made_parent = not self.path.parent.exists()
        self.lock = FolderLock(self.path, "training") if world.is_main else None

    def check_new(self) -> None:
        if self.path.exists() and any(self.path.iterdir()):
            raise LmforgeError(f"run folder {self.path} already exists: continue it with "
                               f"--resume {self.path}, or pick another --name")

    def latest_checkpoint(self, cfg: Config, policy: str) -> tuple[Path, dict]:
        """The newest good checkpoint and its state.json, checked against the config `cfg` and its
        precision `policy` before any data is prepared or model built: a checkpoint of an older
        format, of another model or data (the run's config.yaml edited, emptied or cut short),
        precision or length stops here. Reads only."""
        path = find_checkpoint(self.path, warn=self.warn)
        state = read_state(path)
        check_format(path, state)
        ours, theirs = self.path / "config.yaml", path / "config.yaml"
        lacking, change = lacking_key(ours, theirs), resume_change(load_config(theirs), cfg)
        if lacking is not None or change is not None:
            problem = (f"lacks {lacking} (cut short or edited)" if lacking is not None else
                       f"does not match: {change[0]} is {change[1]!r} there, {change[2]!r} in the checkpoint")
            raise LmforgeError(f"{ours} {problem}; copy checkpoint {path}'s config.yaml over it to resume")
        if state["precision"]["policy"] != policy:
            raise LmforgeError(f"checkpoint {path} was trained with train.precision={state['precision']['policy']}, "
                               f"not {policy}: resume with the same precision (its optimizer state, loss scale and "
                               f"fp8 scales belong to it), or start a new run")
        step, max_steps = state["step"], cfg.train.max_steps
        if step > max_steps or (step == max_steps and (self.path / "summary.json").is_file()):
            raise LmforgeError(f"{self.path} already reached step {step} of train.max_steps={max_steps}: "
                               f"pass a larger train.max_steps to continue")
        return path, state

    def restore(self, path: Path, state: dict, engine, data) -> tuple[RunState, list[str]]:
        """Check that checkpoint `path` (found by latest_checkpoint) was trained with the tokenizer
        of `data`, then load weights, optimizer state and RNG; returns the run state and the metrics
        lines to keep. Reads only."""
        if state["tokenizer_sha256"] != data.meta["tokenizer_sha256"]:
            raise LmforgeError(f"checkpoint {path} was trained with another tokenizer than the one in "
                               f"{data.dir}: pass data.dir=FOLDER, the run's original data")
        metrics_kept = lines_to_keep(self.path / "metrics.jsonl", state["step"], warn=self.warn)
        load_engine_weights(engine, path)
        load_optimizer_state(engine, path, state["param_groups"])
        load_rng_states(path, self.world.device)
        fields = RunState.__dataclass_fields__
        return RunState(**{key: value for key, value in state["run"].items() if key in fields}), metrics_kept

    def write_start(self, config_yaml: str, tokenizer_json: str) -> None:
        """The first writes of a session: the folder, and the config and tokenizer it runs with (on
        resume the config may carry new train.* settings, and a damaged tokenizer.json is repaired); the
        leftovers of a save killed half way are removed."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.remove_partials()
        for name, text in (("config.yaml", config_yaml), ("tokenizer.json", tokenizer_json)):  # whole or not at all
            write_file_staged(self.path / name, lambda path, text=text: path.write_text(text))

    def remove_partials(self) -> None:
        """Remove the staging folders of saves that were killed or failed half way (rank 0's task)."""
        root = self.path / CHECKPOINT_DIR
        if self.world.is_main and root.is_dir():
            for leftover in [*root.glob(".step_*.partial"), *root.glob(".step_*.stale")]:
                shutil.rmtree(leftover, ignore_errors=True)

    def save(self, run: RunState, engine, extra_state: dict, files: dict[str, bytes], keep: int) -> Path:
        self.remove_partials()  # before the save, as well: one a failed save of this session left
        state = {"run": asdict(run), **extra_state}
        return save_checkpoint(self.path, run.step, engine, state, files, keep=keep, world=self.world)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            if self.made_parent and not any(self.path.parent.iterdir()):  # a refused new run leaves no runs/
                self.path.parent.rmdir()
