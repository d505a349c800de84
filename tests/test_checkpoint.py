import json
import shutil

import pytest
import torch

from lmforge.config import make_config
from lmforge.errors import LmforgeError
from lmforge.model.transformer import Transformer
from lmforge.train import checkpoint as ckpt
from lmforge.train.trainer import Trainer


def quiet_trainer(cfg, run_dir, resume=False):
    from rich.console import Console

    return Trainer(cfg, run_dir, resume=resume, console=Console(quiet=True), progress=False)


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def losses(run_dir):
    return [(r["step"], r.get("train_loss"), r.get("val_loss"))
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


class Killed(Exception):
    pass


def run_until_killed(cfg, run_dir, kill_at_step, monkeypatch):
    """Train, and 'kill' the process inside step `kill_at_step` (after the backward pass)."""
    trainer = quiet_trainer(cfg, run_dir)
    real_step = trainer.optimizer.step

    def step_or_die(*args, **kwargs):
        if trainer.step + 1 == kill_at_step:
            raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", step_or_die)
    with pytest.raises(Killed):
        trainer.run()


def test_resume_gives_the_same_parameters_as_an_uninterrupted_run(tiny_config, tmp_path, monkeypatch):
    # dropout makes the RNG state part of what must be restored; grad_accum exercises the loader
    cfg = tiny_config("model.dropout=0.1", max_steps=12, checkpoint_interval=4, grad_accum=2)
    straight = quiet_trainer(cfg, tmp_path / "straight")
    straight.run()

    run_until_killed(cfg, tmp_path / "resumed", kill_at_step=7, monkeypatch=monkeypatch)
    assert ckpt.find_checkpoint(tmp_path / "resumed").name == "step_0000004"
    resumed = quiet_trainer(cfg, tmp_path / "resumed", resume=True)
    assert resumed.step == 4
    resumed.run()

    expected, actual = parameters(straight), parameters(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")
    for p_straight, p_resumed in zip(straight.model.parameters(), resumed.model.parameters()):
        a, b = straight.optimizer.state[p_straight], resumed.optimizer.state[p_resumed]
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_kill_during_a_save_keeps_the_previous_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=8, checkpoint_interval=4)
    run_dir = tmp_path / "run"
    trainer = quiet_trainer(cfg, run_dir)
    real_save_file = ckpt.save_file

    def save_file_or_die(tensors, path, *args, **kwargs):
        if "step_0000008" in str(path) and path.endswith("optimizer.safetensors"):
            raise Killed  # model.safetensors of step 8 is already on disk, half a checkpoint
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", save_file_or_die)
    with pytest.raises(Killed):
        trainer.run()
    monkeypatch.setattr(ckpt, "save_file", real_save_file)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_0000004"]
    assert ckpt.find_checkpoint(run_dir).name == "step_0000004"
    assert (run_dir / "checkpoints" / ".step_0000008.partial").is_dir()  # the half-written one, ignored
    resumed = quiet_trainer(cfg, run_dir, resume=True)
    assert resumed.step == 4
    resumed.run()
    assert ckpt.find_checkpoint(run_dir).name == "step_0000008"
    assert not any(p.name.endswith(".partial") for p in (run_dir / "checkpoints").iterdir())


def test_old_checkpoints_are_pruned(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=8, checkpoint_interval=2, keep_checkpoints=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step_0000006", "step_0000008"]


def test_corrupt_checkpoint_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=4)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = ckpt.find_checkpoint(tmp_path / "run")
    weights = path / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(LmforgeError, match="model.safetensors does not match its checksum"):
        quiet_trainer(tiny_config(max_steps=8), tmp_path / "run", resume=True)
    weights.write_bytes(original)
    ckpt.verify_checkpoint(path)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(LmforgeError, match="optimizer.safetensors is missing"):
        ckpt.verify_checkpoint(path)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=8, checkpoint_interval=4)
    quiet_trainer(cfg, tmp_path / "run").run()
    newest = ckpt.find_checkpoint(tmp_path / "run")
    assert newest.name == "step_0000008"
    with open(newest / "optimizer.safetensors", "r+b") as f:
        f.truncate(64)
    warnings = []
    assert ckpt.find_checkpoint(tmp_path / "run", warn=warnings.append).name == "step_0000004"
    assert len(warnings) == 1 and "step_0000008 is corrupt: optimizer.safetensors" in warnings[0]


def test_truncated_weights_are_reported_not_crashed(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2, checkpoint_interval=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = ckpt.find_checkpoint(tmp_path / "run")
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(LmforgeError, match="is corrupt"):
        ckpt.load_model_weights(Transformer(cfg.model), path)


def test_checkpoint_from_another_shape_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = ckpt.find_checkpoint(tmp_path / "run")
    wider = make_config("tiny", overrides=["model.d_model=128"]).model
    with pytest.raises(LmforgeError, match=r"different shape: blocks.0.attn_norm.weight is \(64,\) there, \(128,\) here"):
        ckpt.load_model_weights(Transformer(wider), path)
    deeper = make_config("tiny", overrides=["model.n_layers=3"]).model
    with pytest.raises(LmforgeError, match="lacks 'blocks.2"):
        ckpt.load_model_weights(Transformer(deeper), path)


def test_tied_weights_are_stored_once_and_reloaded_tied(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    trainer.run()
    path = ckpt.find_checkpoint(tmp_path / "run")
    model = Transformer(cfg.model)
    ckpt.load_model_weights(model, path)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert torch.equal(model.lm_head.weight, trainer.model.lm_head.weight)


def test_resume_of_a_finished_run_says_how_to_continue(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    with pytest.raises(LmforgeError, match="already reached step 2 of train.max_steps=2"):
        quiet_trainer(cfg, tmp_path / "run", resume=True)


def test_a_run_folder_is_never_overwritten(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(LmforgeError, match="already exists: continue it with --resume"):
        quiet_trainer(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_run_without_any_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(LmforgeError, match="has no checkpoint"):
        ckpt.find_checkpoint(tmp_path / "run")
    with pytest.raises(LmforgeError, match="does not exist"):
        ckpt.find_checkpoint(tmp_path / "missing")


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=8, checkpoint_interval=2, log_interval=1)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    real_step = trainer.train_step

    def diverging_step():
        loss, norm = real_step()
        return (loss * float("nan"), norm) if trainer.step == 3 else (loss, norm)

    monkeypatch.setattr(trainer, "train_step", diverging_step)
    with pytest.raises(LmforgeError, match=r"the loss became nan at step 3 \(.*\); the last good checkpoint "
                                           r"is kept: \S*step_0000002;"):
        trainer.run()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step_0000002"]
