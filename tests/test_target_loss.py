"""train.target_loss: a run stops at the first evaluation whose validation loss reaches it, with a
checkpoint and a summary saying so; train.eval_seed: the validation batches, whatever train.seed
(bench/speedrun.py times runs of several seeds to a target this way)."""

import json

import pytest
from rich.console import Console

from lmforge.cli import main
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.runs.checkpoint.find import find_checkpoint
from lmforge.modes import get_policy
from lmforge.train.evaluate import evaluate
from lmforge.train.loop import Trainer
from tests.conftest import tiny_overrides


def quiet_trainer(cfg, run_dir, resume=False):
    return Trainer(cfg, run_dir, resume=resume, console=Console(quiet=True), progress=False)


def val_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


@pytest.fixture(scope="module")
def straight(tiny_config, tmp_path_factory):
    """Eight steps with no target, evaluated every 2: the losses a target run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    quiet_trainer(tiny_config(max_steps=8, eval_interval=2, checkpoint_interval=0), run_dir).run()
    return val_losses(run_dir)


@pytest.fixture(scope="module")
def tiny_config(corpus_dir, data_dir):  # module-scoped twin of conftest's, for the module fixture above
    return lambda *extra, **train: make_config("tiny", overrides=[*tiny_overrides(corpus_dir, data_dir, **train),
                                                                  *extra])


def target_config(tiny_config, straight, target=None):
    # halfway between the losses at steps 2 and 4: step 4's evaluation is the first to reach it
    # (the runs are deterministic, so the losses are the straight run's to the last bit)
    assert straight[2] > straight[4]
    target = (straight[2] + straight[4]) / 2 if target is None else target
    return tiny_config(max_steps=8, eval_interval=2, checkpoint_interval=0, target_loss=target)


def test_a_run_stops_at_the_evaluation_that_reaches_the_target(tiny_config, straight, tmp_path, capsys):
    cfg = target_config(tiny_config, straight)
    summary = quiet_trainer(cfg, tmp_path / "run").run()
    assert (summary["steps"], summary["target_reached_step"]) == (4, 4)
    assert summary["target_loss"] == cfg.train.target_loss and summary["val_loss"] == straight[4]
    assert val_losses(tmp_path / "run") == {2: straight[2], 4: straight[4]}
    assert find_checkpoint(tmp_path / "run").name == "step_0000004"  # the last step's checkpoint
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "train_loss" in r) == 4  # its window logged
    # the summary table says so (through the CLI, as a user sees it)
    overrides = tiny_overrides(cfg.data.source, cfg.data.dir, max_steps=8, eval_interval=2, checkpoint_interval=0,
                               target_loss=cfg.train.target_loss)
    assert main(["train", "--model", "tiny", "--out", str(tmp_path / "cli"), "--no-progress", *overrides]) == 0
    assert "target reached at step 4" in capsys.readouterr().out


def test_a_target_not_reached_runs_to_max_steps_and_says_so(tiny_config, straight, tmp_path):
    summary = quiet_trainer(target_config(tiny_config, straight, target=0.5), tmp_path / "run").run()
    assert (summary["steps"], summary["target_reached_step"]) == (8, None)


def test_resuming_a_run_that_reached_its_target(tiny_config, straight, tmp_path):
    cfg = target_config(tiny_config, straight)
    quiet_trainer(cfg, tmp_path / "run").run()
    with pytest.raises(LmforgeError, match=r"already reached train.target_loss=.* train.target_loss=null"):
        quiet_trainer(cfg, tmp_path / "run", resume=True)
    # killed after its checkpoint, before its summary: the resume writes the summary, trains nothing
    (tmp_path / "run" / "summary.json").unlink()
    summary = quiet_trainer(cfg, tmp_path / "run", resume=True).run()
    assert (summary["steps"], summary["target_reached_step"]) == (4, 4)
    # without the target it trains on to max_steps, exactly as the straight run did
    unset = tiny_config(max_steps=8, eval_interval=2, checkpoint_interval=0, target_loss="null")
    summary = quiet_trainer(unset, tmp_path / "run", resume=True).run()
    assert summary["steps"] == 8 and "target_reached_step" not in summary
    assert val_losses(tmp_path / "run") == straight


def test_a_bad_target_is_one_line():
    with pytest.raises(LmforgeError, match="train.target_loss must be positive, got -1.0"):
        make_config("tiny", overrides=["train.target_loss=-1"])


def test_eval_seed_picks_the_validation_batches_whatever_the_training_seed(tiny_config, tmp_path):
    cfg = tiny_config("train.seed=5", "train.eval_seed=1338", max_steps=2, checkpoint_interval=0)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    logged = trainer.run()["val_loss"]
    t = cfg.train

    def val_loss(seed):
        return evaluate(trainer.model, trainer.data.val, t.batch_size, cfg.seq_len, seed, t.eval_batches,
                        trainer.device, get_policy(t.precision))

    assert val_loss(1338) == logged != val_loss(t.seed + 1)  # the default's batches are others


def test_eval_batch_size_validates_runs_of_different_batch_sizes_on_the_same_windows(tiny_config, tmp_path):
    """A batch of 4 draws the 2 windows of a batch of 2 and 2 more: without train.eval_batch_size a run of
    batch 4 is validated on other windows than one of batch 2; with train.eval_batch_size=2, on the same."""
    cfg = tiny_config("train.eval_seed=1338", "train.eval_batch_size=2", max_steps=2, checkpoint_interval=0)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    logged = trainer.run()["val_loss"]
    t = cfg.train

    def val_loss(rows):
        return evaluate(trainer.model, trainer.data.val, rows, cfg.seq_len, 1338, t.eval_batches, trainer.device,
                        get_policy(t.precision))

    assert (t.batch_size, t.eval_batch_size) == (4, 2)
    assert logged == val_loss(2) != val_loss(t.batch_size)
