"""`lmforge train --resume RUN` as a user runs it (the real CLI, in a subprocess): every check of the
checkpoint against the run's config comes before anything is written, and the run records where
its data is, so that a resume from another directory trains on the same prepared data.

The tiny run is trained once, in folder `started` with the default data folder (relative:
data/<corpus>-bpe512), as a user's first run is."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from tests.conftest import tiny_overrides

DEADLINE_S = 300  # for one command on a loaded 2-core machine
ROOT = Path(__file__).resolve().parents[1]


def lmforge(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's lmforge from any folder
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=DEADLINE_S, env=env)


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones included) by its path, with the sha256 of its bytes."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def started(tmp_path_factory, corpus_dir) -> Path:
    """A folder in which a tiny run (runs/tiny) was trained 2 steps and saved, its data prepared there."""
    folder = tmp_path_factory.mktemp("started")
    overrides = [item for item in tiny_overrides(corpus_dir, Path("unused"), max_steps=2, checkpoint_interval=2,
                                                 eval_interval=2) if not item.startswith("data.dir=")]
    result = lmforge("train", "--model", "tiny", "--out", "runs/tiny", "--no-progress", *overrides, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert len(list((folder / "data").iterdir())) == 1  # data/<corpus>-<hash>-bpe512
    return folder


def data_folder(started: Path) -> Path:
    (folder,) = (started / "data").iterdir()
    return folder


def test_a_run_records_its_data_and_a_resume_from_elsewhere_uses_it(started, tmp_path):
    run, data = started / "runs" / "tiny", data_folder(started)
    prepared = tree(data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = lmforge("train", "--resume", str(run), "--no-progress", "train.max_steps=4", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert list(elsewhere.iterdir()) == []  # no data prepared again here
    assert "preparing" not in result.stdout and f"resuming {run} at step 2" in result.stdout
    assert tree(data) == prepared
    assert load_config(run / "config.yaml").data.dir == str(data)  # recorded absolute: where it was prepared

    # the recorded folder gone: one line says what happens (prepared again where it was), and it is
    shutil.rmtree(data)
    result = lmforge("train", "--resume", str(run), "--no-progress", "train.max_steps=6", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("note: the run's data folder")]
    assert lines == [f"note: the run's data folder {data} is not there: preparing it again from "
                     f"data.source={load_config(run / 'config.yaml').data.source} (pass data.dir=FOLDER if it "
                     f"lies elsewhere)"]
    assert tree(data) == prepared and list(elsewhere.iterdir()) == []  # the same tokenizer, the same tokens


def edit_yaml(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("damage, says", [
    (lambda config: config.write_text(""), "config.yaml lacks model.family (cut short or edited); copy checkpoint"),
    (lambda config: edit_yaml(config, "d_model: 64", "d_model: 128"), "config.yaml does not match: model.d_model "
                                                                      "is 128 there, 64 in the checkpoint"),
    (lambda config: config.write_text(config.read_text()[:config.read_text().index("optim:")]),  # cut short
     "config.yaml lacks optim."),
    (lambda config: edit_yaml(config, "n_layers: 2", "n_layers: two"), "n_layers must be int, got 'two'"),
    (lambda config: config.write_text("- model\n"), "must hold a mapping of sections"),
])
def test_a_damaged_config_is_refused_in_one_line_before_anything_is_written(started, tmp_path, damage, says):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(started / "runs" / "tiny", run)
    damage(run / "config.yaml")
    data = data_folder(started)
    before, prepared = tree(tmp_path), tree(data)
    result = lmforge("train", "--resume", "runs/tiny", "--no-progress", "train.max_steps=4", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmforge: error: ") and says in lines[0], result.stderr
    assert tree(tmp_path) == before and tree(data) == prepared  # no data folder made, no run file changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.parametrize("command", [["runs", "runs"], ["report", "runs/tiny"], ["plan", "runs/tiny"]])
@pytest.mark.parametrize("checkpoints", ["kept", "none"])
def test_a_run_whose_config_was_cut_short_is_not_read_as_defaults(started, tmp_path, command, checkpoints):
    """`lmforge runs`, `report` and `plan RUN` read a run's config.yaml, as a resume does: emptied or cut
    short, its defaults are not the run's (they listed the default model and 900 steps for a 2-step
    tiny run, and planned the default model), so they refuse it in resume's line, writing nothing."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(started / "runs" / "tiny", run)
    if checkpoints == "none":  # a run that stopped before its first checkpoint: its sections are checked
        shutil.rmtree(run / "checkpoints")
    config = run / "config.yaml"
    config.write_text(config.read_text()[:config.read_text().index("optim:")])
    before = tree(tmp_path)
    result = lmforge(*command, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    says = ("config.yaml lacks optim." if checkpoints == "kept" else "config.yaml lacks optim (cut short or edited)")
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", [["runs", "runs"], ["report", "runs/tiny"], ["plan", "runs/tiny"]])
def test_a_damaged_checkpoint_config_does_not_stop_reading_a_whole_run(started, tmp_path, command):
    """The newest checkpoint's config.yaml gone: the run's whole config.yaml still reads (an earlier
    checkpoint's copy, or the sections, is what it is checked against)."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(started / "runs" / "tiny", run)
    newest = sorted((run / "checkpoints").iterdir())[-1]  # an earlier test resumed the run: several
    (newest / "config.yaml").unlink()
    result = lmforge(*command, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_new_run_into_a_run_folder_is_refused_before_its_data_is_prepared(started, tmp_path, corpus_dir):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(started / "runs" / "tiny", run)
    before = tree(tmp_path)
    result = lmforge("train", "--model", "tiny", "--out", "runs/tiny", "--no-progress", f"data.source={corpus_dir}",
                     cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("lmforge: error: run folder runs/tiny already exists: continue it with --resume "
                                     "runs/tiny, or pick another --name")
    assert tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no data/ here


def test_a_resume_whose_data_is_gone_and_whose_corpus_changed_is_refused_before_preparing(tmp_path, corpus_dir):
    """The recorded data folder gone and the corpus edited since: preparing it again would train
    another tokenizer than the checkpoint's. That is found once the tokenizer is trained, before
    the token files or the folder are written: one line, exit 2, the run folder as it was."""
    corpus, data = tmp_path / "corpus", tmp_path / "data" / "tiny"
    shutil.copytree(corpus_dir, corpus)
    overrides = tiny_overrides(corpus, data, max_steps=2, checkpoint_interval=2, eval_interval=2)
    run = tmp_path / "run"
    assert lmforge("train", "--model", "tiny", "--out", str(run), "--no-progress", *overrides,
                   cwd=tmp_path).returncode == 0
    shutil.rmtree(data)
    first = sorted(corpus.iterdir())[0]
    first.write_text(first.read_text().replace("def ", "define_a_function ").replace("self", "this_object"))
    before = tree(run)
    result = lmforge("train", "--resume", str(run), "--no-progress", "train.max_steps=4", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmforge: error:")]
    assert len(errors) == 1 and "no longer gives the tokenizer" in errors[0], result.stderr
    assert not data.exists() and not list(data.parent.glob(".tiny.partial-*")) and tree(run) == before
