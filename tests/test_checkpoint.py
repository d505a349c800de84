import json

import pytest
import torch

from lmforge.config import make_config
from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import Transformer
from lmforge.parallel.parallelize import Engine
from lmforge.runs.checkpoint import write as checkpoint_write
from lmforge.runs.checkpoint.find import file_sha256, find_checkpoint, list_checkpoints, verify_checkpoint
from lmforge.runs.checkpoint.read import load_model_weights, load_optimizer_state
from lmforge.runs.checkpoint.tensors import stored_tensors
from lmforge.runs.folders import export_run
from lmforge.runs.load import base_identity, base_settings, load_base
from lmforge.train.loop import Trainer


def quiet_trainer(cfg, run_dir, resume=False):
    from rich.console import Console

    return Trainer(cfg, run_dir, resume=resume, console=Console(quiet=True), progress=False)


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def logged(run_dir):
    """Every metrics record without its timing and process fields (those differ between any two runs)."""
    timing = {"tokens_per_s", "mfu", "hfu", "time", "elapsed_s", "peak_memory_bytes"}
    return [{k: v for k, v in record.items() if k not in timing}
            for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def assert_same_state_dict(a, b, where=""):
    """Equal structure, types and values; tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state_dict(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state_dict(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


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
    # dropout makes the RNG state part of what must be restored; grad_accum exercises the loader;
    # checkpoints every 5 steps and logs every 2: the resume (step 5) falls inside a logging window
    cfg = tiny_config("model.dropout=0.1", max_steps=12, checkpoint_interval=5, log_interval=2, grad_accum=2)
    straight = quiet_trainer(cfg, tmp_path / "straight")
    straight.run()

    run_until_killed(cfg, tmp_path / "resumed", kill_at_step=8, monkeypatch=monkeypatch)
    assert find_checkpoint(tmp_path / "resumed").name == "step_0000005"
    resumed = quiet_trainer(cfg, tmp_path / "resumed", resume=True)
    assert resumed.step == 5
    resumed.run()

    expected, actual = parameters(straight), parameters(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert logged(tmp_path / "straight") == logged(tmp_path / "resumed")
    # the restored optimizer is the saved one, types included (JSON has no tuples: AdamW's betas)
    assert_same_state_dict(straight.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    for p_straight, p_resumed in zip(straight.model.parameters(), resumed.model.parameters()):
        assert straight.optimizer.state[p_straight].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_a_kill_during_a_save_keeps_the_previous_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=8, checkpoint_interval=4)
    run_dir = tmp_path / "run"
    trainer = quiet_trainer(cfg, run_dir)
    real_save_tensors = checkpoint_write.save_tensors

    def save_tensors_or_die(tensors, folder):
        if "step_0000008" in str(folder) and folder.name == "optimizer":
            raise Killed  # the model of step 8 is already on disk, half a checkpoint
        return real_save_tensors(tensors, folder)

    monkeypatch.setattr(checkpoint_write, "save_tensors", save_tensors_or_die)
    with pytest.raises(Killed):
        trainer.run()
    monkeypatch.setattr(checkpoint_write, "save_tensors", real_save_tensors)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_0000004"]
    assert find_checkpoint(run_dir).name == "step_0000004"
    assert (run_dir / "checkpoints" / ".step_0000008.partial").is_dir()  # the half-written one, ignored
    resumed = quiet_trainer(cfg, run_dir, resume=True)
    assert resumed.step == 4
    resumed.run()
    assert find_checkpoint(run_dir).name == "step_0000008"
    assert not any(p.name.endswith(".partial") for p in (run_dir / "checkpoints").iterdir())


def test_old_checkpoints_are_pruned(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=8, checkpoint_interval=2, keep_checkpoints=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000006", "step_0000008"]


def test_corrupt_checkpoint_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=4)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = find_checkpoint(tmp_path / "run")
    weights = path / "model" / "__0_0.distcp"
    original = weights.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(LmforgeError, match="model/__0_0.distcp does not match its checksum"):
        quiet_trainer(tiny_config(max_steps=8), tmp_path / "run", resume=True)
    weights.write_bytes(original)
    verify_checkpoint(path)
    (path / "optimizer" / "__0_0.distcp").unlink()
    with pytest.raises(LmforgeError, match="optimizer/__0_0.distcp is missing"):
        verify_checkpoint(path)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tiny_config, tmp_path, capsys):
    cfg = tiny_config(max_steps=8, checkpoint_interval=4)
    quiet_trainer(cfg, tmp_path / "run").run()
    newest = find_checkpoint(tmp_path / "run")
    assert newest.name == "step_0000008"
    with open(newest / "optimizer" / "__0_0.distcp", "r+b") as f:
        f.truncate(64)
    warnings = []
    assert find_checkpoint(tmp_path / "run", warn=warnings.append).name == "step_0000004"
    assert len(warnings) == 1 and "step_0000008 is corrupt: optimizer/__0_0.distcp" in warnings[0]
    capsys.readouterr()
    assert export_run(tmp_path / "run").name == "hf-step_0000004"  # exported from the earlier one, and said
    assert capsys.readouterr().err.count("warning: skipping checkpoint") == 1
    # as a fine-tuning base: every reader of the base takes the earlier one, said once per process
    assert base_identity(tmp_path / "run")["checkpoint"] == "step_0000004"
    base_settings(tmp_path / "run"), load_base(tmp_path / "run")
    assert capsys.readouterr().err.count("warning: skipping checkpoint") == 1


def test_truncated_weights_are_reported_not_crashed(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2, checkpoint_interval=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = find_checkpoint(tmp_path / "run")
    with open(path / "model" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(LmforgeError, match="is corrupt"):
        load_model_weights(Transformer(cfg.model), path)


def test_checkpoint_from_another_shape_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = find_checkpoint(tmp_path / "run")
    wider = make_config("tiny", overrides=["model.d_model=128"]).model
    with pytest.raises(LmforgeError, match=r"different shape: tok_embeddings.weight is \(512, 64\) there, \(512, 128\) here"):
        load_model_weights(Transformer(wider), path)
    deeper = make_config("tiny", overrides=["model.n_layers=3"]).model
    with pytest.raises(LmforgeError, match=r"lacks 9 \(blocks.2.attn_norm.weight, blocks.2.attn.q_proj.weight, "):
        load_model_weights(Transformer(deeper), path)
    shallower = make_config("tiny", overrides=["model.n_layers=1"]).model
    with pytest.raises(LmforgeError, match=r"holds 9 \(blocks.1.attn.k_proj.weight, .*\) tensors this model does not have"):
        load_model_weights(Transformer(shallower), path)


def test_state_is_loaded_by_name_and_a_partial_load_is_an_explicit_choice(tiny_config, tmp_path):
    """Keys are parameter names, so state finds its parameter wherever it sits: a model with one more
    layer loads the two it shares with strict=False, and the optimizer's state follows the names."""
    from lmforge.train.setup import build

    cfg = tiny_config(max_steps=2)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    trainer.run()
    path = find_checkpoint(tmp_path / "run")
    keys = set(stored_tensors(path, "optimizer"))
    assert "blocks.1.mlp.down_proj.weight.exp_avg" in keys and "tok_embeddings.weight.step" in keys
    state = json.loads((path / "state.json").read_text())
    assert state["param_groups"][0]["params"][:2] == ["tok_embeddings.weight", "blocks.0.attn.q_proj.weight"]

    deeper = make_config("tiny", overrides=["model.n_layers=3"]).model
    model = Transformer(deeper)
    missing, unexpected = load_model_weights(model, path, strict=False)
    assert unexpected == [] and len(missing) == 9 and all(n.startswith("blocks.2.") for n in missing)
    torch.testing.assert_close(model.blocks["1"].mlp.up_proj.weight, trainer.model.blocks["1"].mlp.up_proj.weight)

    # full recomputation wraps the blocks; the names, and so the state, are the same
    wrapped_cfg = tiny_config("train.recompute=full", max_steps=2)
    model, optimizer = build(wrapped_cfg)
    load_model_weights(model, path)
    load_optimizer_state(Engine(model, optimizer), path, state["param_groups"])
    assert optimizer.state_dict()["param_groups"] == trainer.optimizer.state_dict()["param_groups"]
    param = model.blocks["1"].attn.v_proj.weight
    torch.testing.assert_close(optimizer.state[param]["exp_avg"],
                               trainer.optimizer.state[trainer.model.blocks["1"].attn.v_proj.weight]["exp_avg"],
                               rtol=0, atol=0)
    # an optimizer over other parameters is refused, naming them
    other, other_optimizer = build(make_config("tiny", overrides=["model.n_layers=1"]))
    with pytest.raises(LmforgeError, match=r"only in the checkpoint: 9 \(blocks.1"):
        load_optimizer_state(Engine(other, other_optimizer), path, state["param_groups"])


def test_a_checkpoint_keyed_by_position_is_refused_with_one_line(tiny_config, tmp_path, capsys):
    from lmforge.cli import main

    cfg = tiny_config(max_steps=2)
    quiet_trainer(cfg, tmp_path / "run").run()
    path = find_checkpoint(tmp_path / "run")
    state = json.loads((path / "state.json").read_text())
    del state["format"]  # what an older lmforge wrote
    (path / "state.json").write_text(json.dumps(state))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["state.json"] = {"bytes": (path / "state.json").stat().st_size, "sha256": file_sha256(path / "state.json")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert main(["train", "--resume", str(tmp_path / "run"), "train.max_steps=4"]) == 2
    assert "written by an older lmforge" in capsys.readouterr().err


def test_tied_weights_are_stored_once_and_reloaded_tied(tiny_config, tmp_path):
    cfg = tiny_config(max_steps=2)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    trainer.run()
    path = find_checkpoint(tmp_path / "run")
    model = Transformer(cfg.model)
    load_model_weights(model, path)
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
        find_checkpoint(tmp_path / "run")
    with pytest.raises(LmforgeError, match="does not exist"):
        find_checkpoint(tmp_path / "missing")


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=8, checkpoint_interval=2, log_interval=1)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    real_step = trainer.train_step

    def diverging_step():
        if trainer.step == 2:  # the weights go bad before step 3: its loss is nan, for real
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))
        return real_step()

    monkeypatch.setattr(trainer, "train_step", diverging_step)
    with pytest.raises(LmforgeError, match=r"the loss became nan at step 3; the last good checkpoint is kept: "
                                           r"\S*step_0000002;"):
        trainer.run()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000002"]


@pytest.mark.parametrize("bad_step, poison, kept", [
    (1, "parameter", "there is no checkpoint yet"),
    (3, "moment", r"the last good checkpoint is kept: \S*step_0000002;"),
])
def test_a_checkpoint_never_holds_inf_or_nan(tiny_config, tmp_path, monkeypatch, bad_step, poison, kept):
    # the loss of the poisoned step is finite (computed before its update): only the save can notice
    cfg = tiny_config(max_steps=8, checkpoint_interval=1, log_interval=1)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    real_step = trainer.optimizer.step
    weight = trainer.model.tok_embeddings.weight

    def step_then_poison(*args, **kwargs):
        real_step(*args, **kwargs)
        if trainer.step + 1 == bad_step:
            target = weight if poison == "parameter" else trainer.optimizer.state[weight]["exp_avg"]
            target.data[0, 0] = float("nan") if poison == "moment" else float("inf")

    monkeypatch.setattr(trainer.optimizer, "step", step_then_poison)
    what = "tok_embeddings.weight" if poison == "parameter" else "optimizer state exp_avg of tok_embeddings.weight"
    with pytest.raises(LmforgeError, match=rf"step {bad_step} left inf/NaN in {what}, so it was not saved; {kept}"):
        trainer.run()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [f"step_{s:07d}" for s in range(1, bad_step)]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))


def test_a_save_that_does_not_fit_keeps_the_previous_checkpoint_and_no_partial(tiny_config, tmp_path, monkeypatch):
    import errno

    cfg = tiny_config(max_steps=8, checkpoint_interval=2)
    run_dir = tmp_path / "run"
    trainer = quiet_trainer(cfg, run_dir)
    real_save_tensors = checkpoint_write.save_tensors

    def save_tensors_or_full(tensors, folder):
        if "step_0000004" in str(folder) and folder.name == "optimizer":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save_tensors(tensors, folder)

    monkeypatch.setattr(checkpoint_write, "save_tensors", save_tensors_or_full)
    with pytest.raises(LmforgeError, match=r"checkpoint \S*step_0000004 could not be written \(No space left on "
                                           r"device .*\); its partial folder is removed and the last good "
                                           r"checkpoint is kept: \S*step_0000002;"):
        trainer.run()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000002"]
    verify_checkpoint(run_dir / "checkpoints" / "step_0000002")


def test_a_run_killed_between_its_last_checkpoint_and_its_summary_can_be_finished(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=4, checkpoint_interval=4)
    trainer = quiet_trainer(cfg, tmp_path / "run")

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr("lmforge.train.loop.write_summary", killed)
    with pytest.raises(Killed):
        trainer.run()
    monkeypatch.undo()
    assert not (tmp_path / "run" / "summary.json").exists()
    records = logged(tmp_path / "run")
    summary = quiet_trainer(cfg, tmp_path / "run", resume=True).run()
    assert summary["steps"] == 4 and summary["train_loss"] == [r for r in records if "train_loss" in r][-1]["train_loss"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4
    assert (tmp_path / "run" / "loss.png").is_file()
    assert logged(tmp_path / "run") == records  # nothing trained or logged twice


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_one_stops_before_any_write(
        tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config(max_steps=8, checkpoint_interval=4, log_interval=1)
    quiet_trainer(cfg, tmp_path / "straight").run()
    run_dir = tmp_path / "run"
    run_until_killed(cfg, run_dir, kill_at_step=7, monkeypatch=monkeypatch)
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    good = metrics.read_text()

    # a damaged line inside the file: refused, and the resume (which would raise max_steps) writes nothing
    lines = good.splitlines()
    metrics.write_text("\n".join([*lines[:2], '{"step": 2, "train_l', *lines[2:]]) + "\n")
    before = {path: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    with pytest.raises(LmforgeError, match=r"metrics.jsonl line 3 is not JSON"):
        quiet_trainer(tiny_config(max_steps=9, checkpoint_interval=4, log_interval=1), run_dir, resume=True)
    assert {path: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before
    assert b"max_steps: 8" in config.read_bytes()

    # a cut-off last line (a full disk mid-write): dropped with a warning
    metrics.write_text(good + '{"step": 7, "train_lo')
    from rich.console import Console

    console = Console(record=True, width=400)
    resumed = Trainer(cfg, run_dir, resume=True, console=console, progress=False)
    assert "ends in a cut-off line" in console.export_text()
    resumed.run()
    assert logged(run_dir) == logged(tmp_path / "straight")


def test_checkpoints_take_config_and_tokenizer_from_memory_not_the_run_folder(tiny_config, tmp_path):
    from lmforge.config import load_config
    from lmforge.data.corpus import load_tokenizer, tokenizer_hash

    cfg = tiny_config(max_steps=2, checkpoint_interval=2)
    trainer = quiet_trainer(cfg, tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").write_text("{ damaged")
    (tmp_path / "run" / "config.yaml").write_text("model: {n_layers: 99}\n")
    trainer.run()
    path = find_checkpoint(tmp_path / "run")
    assert tokenizer_hash(load_tokenizer(path / "tokenizer.json")) == trainer.data.meta["tokenizer_sha256"]
    assert load_config(path / "config.yaml") == cfg
