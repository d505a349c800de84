"""A run's folder and the state that makes it resumable.

    runs/<name>/                 one folder per run, one writer at a time (common/folders.py)
      config.yaml, tokenizer.json   what the run was started (or last resumed) with
      metrics.jsonl                 one record per log or evaluation (train/report.py)
      checkpoints/step_NNNNNNN/     model, optimizer, RNG and `RunState` (runs/checkpoint/)

`RunState` is everything besides tensors that the loop needs to continue exactly: the step, the
tokens trained so far, the logging window (so that a record logged after a resume averages what it would have averaged),
the counts of skipped and bad steps, and the history of losses. `RunFolder` opens a new folder or
restores the newest good checkpoint of an old one; it reads only, until every check has passed.
`Checkpoints` adds what a training checkpoint holds besides the engine's tensors.
Under torchrun every rank has a `RunFolder`, but rank 0 alone holds the lock and writes (the
others read checkpoints, and write their part of each one through `torch.distributed.checkpoint`).
"""

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from rich.console import Console

from lmforge.common.errors import LmforgeError
from lmforge.common.folders import FolderLock, write_file_staged
from lmforge.config import Config, config_to_dict, load_config, resume_change
from lmforge.modes import Policy
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.parallel.world import World
from lmforge.precision.policy import LossScaler, fp8_scale_state, load_fp8_scale_state
from lmforge.runs.checkpoint.find import CHECKPOINT_DIR, check_format, cut_short, find_checkpoint, read_state
from lmforge.runs.checkpoint.read import load_engine_weights, load_optimizer_state, load_rng_states
from lmforge.runs.checkpoint.write import save_checkpoint
from lmforge.runs.load import check_same_base
from lmforge.runs.metrics import lines_to_keep

# the history's key of a run that reached train.target_loss: it ends (Checkpoints.check_target lets
# it resume only to write its summary)
TARGET_REACHED = "target_reached"


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
        problem, change = cut_short(self.path, path), resume_change(load_config(path / "config.yaml"), cfg)
        if problem is None and change is not None:
            problem = (f"{self.path / 'config.yaml'} does not match: {change[0]} is {change[1]!r} there, "
                       f"{change[2]!r} in the checkpoint; copy checkpoint {path}'s config.yaml over it")
        if problem is not None:
            raise LmforgeError(f"{problem} to resume")
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


class Checkpoints:
    """A training run's checkpoints as the Trainer writes and reads them. The engine's tensors and
    the run state go through the RunFolder; a checkpoint holds besides them the precision state (the
    policy's name, the loss scaler, fp8 scales), the global batch, the base a fine-tuning run
    started from, and config.yaml and tokenizer.json as the run was started (kept in memory, not
    re-read from the run folder)."""

    def __init__(self, folder: RunFolder, cfg: Config, data, engine, policy: Policy, scaler: LossScaler,
                 base_identity: dict | None, global_batch: int):
        self.folder, self.cfg, self.data, self.engine = folder, cfg, data, engine
        self.policy, self.scaler, self.base_identity, self.global_batch = policy, scaler, base_identity, global_batch
        self.config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        self.tokenizer_json = data.tokenizer.to_str(pretty=True)
        special = getattr(data, "special", None)  # a fine-tuning base's own token files (train/finetune.py)
        self.token_files = dict(special.files) if special is not None else {}

    def write_start(self) -> None:
        """The run folder's first files (every check has passed)."""
        self.folder.write_start(self.config_yaml, self.tokenizer_json)

    def restore(self, path: Path, state: dict, console: Console) -> tuple[RunState, list[str]]:
        """Load checkpoint `path` once it is checked to fit this run; reads only. Returns its run
        state and the metrics lines to keep."""
        check_same_base(state.get("base"), self.base_identity, path)
        run, metrics_kept = self.folder.restore(path, state, self.engine, self.data)
        self.check_target(run, console)
        precision = state["precision"]
        if "loss_scaler" in precision:
            self.scaler.load_state_dict(precision["loss_scaler"])
        load_fp8_scale_state(self.engine.model, precision.get("fp8_scales", {}))
        saved_config = load_config(path / "config.yaml")
        saved = saved_config.train
        saved_batch = state.get("global_batch", state.get("world_size", 1) * saved.batch_size * saved.grad_accum)
        if "tokens_trained" not in state["run"]:  # a checkpoint from before the count: its steps at its batch
            run.tokens_trained = run.step * saved_batch * saved_config.seq_len
        if saved_batch != self.global_batch:
            console.print(f"note: the global batch changes from {saved_batch} to {self.global_batch} sequences per "
                          f"step; to continue the same training keep train.batch_size x grad_accum x "
                          f"micro_batches x replicas = {saved_batch}", soft_wrap=True)
        run_dir, max_steps = self.folder.path, self.cfg.train.max_steps
        if run.step == max_steps:
            console.print(f"{run_dir} reached step {run.step} but stopped before its summary: writing it")
        else:  # against the schedule the checkpoint was trained under
            note = resume_note(run.step, Schedule.of(saved_config), Schedule.of(self.cfg), max_steps)
            console.print(f"resuming {run_dir} at step {run.step} ({path.name}): {note}",
                          soft_wrap=True)  # one line, however narrow the terminal
        return run, metrics_kept

    def check_target(self, run: RunState, console: Console) -> None:
        """train.target_loss on a resume: a run whose last validation loss already reaches it is
        refused (it would stop at once), unless it reached it and stopped before its summary (then
        the summary is written); with a lower target, or none, it trains on."""
        target, val_loss = self.cfg.train.target_loss, run.history.get("val_loss")
        if target is None or val_loss is None or val_loss > target:
            run.history.pop(TARGET_REACHED, None)
            return
        reached = run.history.get(TARGET_REACHED)
        if reached is not None and not (self.folder.path / "summary.json").is_file():
            console.print(f"{self.folder.path} reached its target at step {reached['step']} but stopped before "
                          f"its summary: writing it", soft_wrap=True)
            return
        raise LmforgeError(f"{self.folder.path} already reached train.target_loss={target:g} (val loss {val_loss:.4f} "
                           f"at step {run.step}): pass a lower train.target_loss, or train.target_loss=null to "
                           f"train on to train.max_steps")

    def save(self, state: RunState) -> Path:
        precision = {"policy": self.policy.name}
        if self.scaler.enabled:
            precision["loss_scaler"] = self.scaler.state_dict()
        if self.policy.fp8:
            precision["fp8_scales"] = self.engine.merged_over_stages(fp8_scale_state(self.engine.model))
        extra = {"tokenizer_sha256": self.data.meta["tokenizer_sha256"], "precision": precision,
                 "global_batch": self.global_batch}
        if self.base_identity is not None:
            extra["base"] = self.base_identity  # a LoRA checkpoint holds only the adapters: which base they fit
        files = {"config.yaml": self.config_yaml.encode(), "tokenizer.json": self.tokenizer_json.encode(),
                 **self.token_files}
        return self.folder.save(state, self.engine, extra, files,
                                keep=self.cfg.train.keep_checkpoints)
