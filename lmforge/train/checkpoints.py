"""A training run's checkpoints as the Trainer writes and reads them.

The engine's tensors and the run state go through runs/state.py's RunFolder; a checkpoint holds
besides them the precision state (the policy's name, the loss scaler, fp8 scales), the global
batch, the base a fine-tuning run started from, and config.yaml and tokenizer.json as the run was
started (kept in memory, not re-read from the run folder).
"""

from pathlib import Path

import yaml
from rich.console import Console

from lmforge.common.errors import LmforgeError
from lmforge.config import Config, config_to_dict, load_config
from lmforge.modes import Policy
from lmforge.optim.schedule import Schedule, resume_note
from lmforge.precision.policy import LossScaler, fp8_scale_state, load_fp8_scale_state
from lmforge.runs.load import check_same_base
from lmforge.runs.state import RunFolder, RunState
from lmforge.train.evaluate import TARGET_REACHED


class Checkpoints:
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
