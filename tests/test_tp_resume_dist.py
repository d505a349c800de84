"""A run trained with tensor parallelism continues at another degree, exports and generates whole.

Real `lmforge train` launches under torchrun (gloo), the tiny model with 4 KV heads
(model.n_kv_heads=4, so that tp=4 divides its heads, KV heads, vocabulary and MLP width), real
prepared data. One uninterrupted run of 6 steps in one process is the reference; each interrupted
run trains 4 steps at one degree and resumes to 6 at another:

    tp=2 x ddp=2 (4 ranks) -> tp=1 (one process)      the checkpoint also exported and generated from
    tp=1 (one process)     -> tp=2 (2 ranks)          with the end-of-run sample (split KV cache)
    tp=4 (4 ranks)         -> tp=2 (2 ranks)          its optimizer state checked whole

Why this works: checkpoints hold whole tensors by name (parallel/tp_engine.py gathers each shard
along its `tp_dim` to save, slices to load), the optimizer's exp_avg and exp_avg_sq too, so the
degree of the saver and of the loader need not match.

Tolerances (fp32), as tests/test_tp_train_dist.py argues them: the split matmuls and all-reduces
sum in another order than one process, so every step differs in the last bits (losses measured to
~1e-7 relative). Losses of every step, the resumed ones included, within 1e-5 absolute of the
uninterrupted run: a resume that lost the optimizer state (Adam restarting from zero moments moves
every weight by ~lr = 1e-3 at once), a shard loaded into the wrong rank or another batch moves the
next loss in the third decimal. Weights: per tensor max |diff| <= 2 x steps x lr (AdamW moves an
element by at most ~lr a step; a gradient element that is itself a cancellation near zero can flip
sign under another summation order) and at most 0.1% of the elements beyond 1e-5.
"""

import json
import shutil
import sys

import pytest
import torch

from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints
from lmforge.runs.checkpoint.read import read_tensors
from lmforge.runs.load import base_checkpoint, model_from_checkpoint
from tests.conftest import tiny_overrides
from tests.test_distributed_train import losses, torchrun
from tests.test_tp_train_dist import run

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, HALF, LR = 6, 4, 1e-3
MODEL = ["model.n_kv_heads=4"]  # tiny's 4 query heads, each its own KV head: tp=4 divides every split


@pytest.fixture(scope="module")
def settings(corpus_dir, data_dir):
    def build(batch_size: int, max_steps: int = HALF) -> list[str]:
        return [*tiny_overrides(corpus_dir, data_dir, max_steps=max_steps, batch_size=batch_size, eval_interval=2,
                                checkpoint_interval=2, log_interval=1), f"optim.decay_steps={STEPS}",
                f"optim.lr={LR}", "train.device=cpu"]
    from lmforge.config import make_config
    from lmforge.data.prepare import prepare_data
    prepare_data(make_config("tiny", overrides=[*build(4), *MODEL]), log=lambda _: None, progress=False)
    return build


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, settings):
    """6 steps in one process, global batch 4; keeps its step-4 and step-6 checkpoints."""
    cwd = tmp_path_factory.mktemp("one")
    run([sys.executable, "-m", "lmforge", "train", "--no-progress", "--model", "tiny", *MODEL,
         *settings(4, STEPS), "--out", "run"], cwd)
    return cwd / "run"


def weights(path) -> dict[str, torch.Tensor]:
    """The whole model of a run folder's newest checkpoint (or of checkpoint `path`), one process."""
    _, model, _ = model_from_checkpoint(path if (path / "state.json").is_file() else base_checkpoint(path))
    return model.state_dict()


def assert_close_weights(a: dict, b: dict, steps: int):
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs()
        assert diff.max().item() <= 2 * steps * LR and (diff > 1e-5).float().mean().item() <= 1e-3, name


def assert_continues_as_uninterrupted(resumed, reference):
    """Steps 1-4 (before) and 5-6 (after the resume) within 1e-5 of the uninterrupted run, and its final weights."""
    got, want = dict(losses(resumed)), dict(losses(reference))
    assert set(got) == set(range(1, STEPS + 1)), sorted(got)
    for step in range(1, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])
    assert_close_weights(weights(resumed), weights(reference), STEPS)


def resume(folder, nproc: int, *overrides: str):
    args = ["--resume", str(folder), f"train.max_steps={STEPS}", *overrides]
    if nproc == 1:
        return run([sys.executable, "-m", "lmforge", "train", "--no-progress", *args], folder.parent)
    return run(torchrun(nproc, *args), folder.parent)


def test_tp2_times_ddp2_exports_and_generates_whole_and_resumes_in_one_process(tmp_path, settings, uninterrupted):
    from transformers import AutoModelForCausalLM

    from lmforge.generate.load import load_for_sampling
    from lmforge.generate.texts import samples
    from lmforge.runs.folders import export_run

    folder = tmp_path / "run"
    run(torchrun(4, "--model", "tiny", *MODEL, *settings(2), "parallel.tp=2", "train.parallel=ddp", "--out", "run"),
        tmp_path)
    step4 = find_checkpoint(folder)
    # the Hugging Face export holds whole weights: the shapes of the one-process run's export, the
    # logits of the checkpoint loaded in one process (HF's Llama against ours on the same weights:
    # fp32 rounding, measured 2.4e-6; a half or misplaced shard moves them by O(1))
    reference_step4 = list_checkpoints(uninterrupted)[-2]
    ours, theirs = export_run(folder, tmp_path / "hf"), export_run(reference_step4, tmp_path / "ref")
    hf = AutoModelForCausalLM.from_pretrained(ours).eval()
    ref = AutoModelForCausalLM.from_pretrained(theirs)
    assert {k: v.shape for k, v in hf.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    _, model, _ = model_from_checkpoint(step4)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=0, atol=2e-5)
    assert_close_weights(model.state_dict(), weights(reference_step4), HALF)
    # `lmforge generate` reads the whole model from the tp run folder: greedy, the text one process makes
    result = run([sys.executable, "-m", "lmforge", "generate", str(folder), "--prompt", "def ", "--max-new-tokens",
                  "12", "--temperature", "0"], tmp_path)
    loaded, special = load_for_sampling(folder)
    expected = next(iter(samples(loaded.model, loaded.tokenizer, "def ", special.end_id, 12, temperature=0.0)))
    assert expected.strip() in result.stdout and len(expected) > len("def ")
    # one process continues with the same global batch (4 rows) from the tp x dp checkpoint
    resume(folder, 1, "parallel.tp=1", "train.parallel=none", "train.batch_size=4")
    assert_continues_as_uninterrupted(folder, uninterrupted)


def test_a_one_process_checkpoint_resumes_at_tp2_and_samples_with_a_split_kv_cache(tmp_path, uninterrupted):
    from lmforge.train.summary import sample

    folder = tmp_path / "run"
    shutil.copytree(uninterrupted, folder)
    shutil.rmtree(list_checkpoints(folder)[-1])  # the step-6 checkpoint: the copy stopped at step 4
    (folder / "summary.json").unlink()
    result = resume(folder, 2, "parallel.tp=2", "train.sample_tokens=16")
    assert "resuming" in result.stdout and "step 4" in result.stdout
    assert_continues_as_uninterrupted(folder, uninterrupted)
    # the end-of-run sample, drawn by both ranks together (each its own KV heads in its cache),
    # is one process's sample from the same weights: the tp logits differ from one process's in
    # the last bits, and a sampled token changes only if the draw falls within that of a boundary
    # of the cumulative distribution (probability ~1e-6 per token)
    cfg, model, tokenizer = model_from_checkpoint(base_checkpoint(folder))
    text = (folder / "sample.txt").read_text()
    prompt = json.loads((folder / "summary.json").read_text())["sample_prompt"]
    end = tokenizer.token_to_id(cfg.data.end_token)
    assert text == sample(model.eval(), tokenizer, prompt, 16, end)
    assert len(text) > len(prompt)


def test_a_tp4_checkpoint_holds_whole_optimizer_state_and_resumes_at_tp2(tmp_path, settings, uninterrupted):
    folder = tmp_path / "run"
    run(torchrun(4, "--model", "tiny", *MODEL, *settings(4), "parallel.tp=4", "--out", "run"), tmp_path)
    # AdamW's moments are saved whole, like their parameters, and equal one process's at step 4:
    # exp_avg is a mean of gradients, exp_avg_sq of their squares, both summed in another order
    # (measured: exp_avg within 2.2e-6 of its largest element, ~5e-9 absolute; exp_avg_sq within
    # 1.2e-10 of values up to 9e-5); a moment saved as one rank's shard has the wrong shape, one
    # gathered in the wrong order differs by the moments themselves (~1e-3 and ~1e-5)
    got = read_tensors(find_checkpoint(folder), "optimizer")
    want = read_tensors(list_checkpoints(uninterrupted)[-2], "optimizer")
    model = weights(find_checkpoint(folder))
    assert got.keys() == want.keys()
    for key, tensor in got.items():
        name, field = key.rsplit(".", 1)
        if field in ("exp_avg", "exp_avg_sq"):
            assert tensor.shape == model[name].shape, key
        torch.testing.assert_close(tensor, want[key], rtol=1e-5, atol=1e-7 if field == "exp_avg" else 2e-9, msg=key)
    resume(folder, 2, "parallel.tp=2")
    assert_continues_as_uninterrupted(folder, uninterrupted)
