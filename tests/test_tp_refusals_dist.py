"""What tensor parallelism refused until issue 23 part 5, now trained under torchrun (parallel.tp=2,
2 ranks, gloo, the `tiny` model, fp32; one launch runs every cell: tests/tp_refusals_worker.py):

    model.logit_softcap     each rank caps its own logits before the vocabulary-parallel loss's
                            sums (parallel/tp_ops.py): trains as one process; saves as planned
    model.dropout           Megatron-LM's model-parallel RNG (parallel/tp_rng.py): see below
    finetune.lora_dropout   a row-parallel adapter's input mask is one process's whole-width mask,
                            sliced (parallel/tp_lora.py): trains as one process, same seed
    finetune.adapter        a PEFT adapter is cut to the split layers' slices (parallel/tp_lora.py):
                            `lmforge finetune --nproc 2 ... parallel.tp=2 --adapter` continues a
                            one-process run's adapter to one process's losses

Tolerances: one-process comparisons are tests/test_tp_dist.py's (fp32 rounding of the summation
order: losses and norms 1e-5 relative, gradients 2e-6 + 1e-4 relative), and the fine-tune's
tests/test_finetune_dist.py's 1e-5; the saved bytes are equal (==), as tests/test_tp_accounting_dist.py's.

Dropout cannot be compared with one process step by step: one process draws one mask over all
heads where each tp rank draws its heads' own. So three properties, each of which a wrong
implementation breaks: (a) the masks on replicated activations (embedding, residual stream) are
the same on both ranks: after 3 steps with dropout the ranks' whole parameters (the norms' gains,
whose gradients are not summed over the ranks) are bit-identical; a rank-own mask there makes them
differ. (b) The attention core's masks (inside the region) differ between the ranks for the same
input and the same generator state, are drawn again alike for the same state (so recomputation,
which restores the generator, reruns the same masks: a run with train.recompute=full equals one
without, bit for bit), and leave the default generator where the bare core leaves it (every rank
advances alike). (c) The loss equals one process's in expectation only: for a model fitted to one
batch, the mean of 32 dropout draws of the loss is above the loss without dropout (the run without
dropout, eval mode) by many standard errors, in tp and in one process alike, and the two means
agree within 4 standard errors of their difference (a wrong mask scale or a missing site moves
the mean by far more; the draws are seeded, so the test is deterministic).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_finetune_dist import assert_same_runs, base, finetune, settings  # noqa: E402, F401 (base: a fixture)
from test_pipeline import run_worker  # noqa: E402
from test_tp_accounting_dist import planned  # noqa: E402
from test_tp_compose_dist import assert_trains_as_one_process, one_process  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "tp_refusals_worker.py"
SOFTCAP = ["model.logit_softcap=2"]  # tiny's initial logits reach |z| ~ 4: a cap of 2 bends them (30 would not)
DROPOUT = ["model.dropout=0.1"]
LORA = ["finetune.lora_rank=4", "finetune.lora_targets=q_proj,v_proj,o_proj,gate_proj,down_proj",  # both kinds
        "finetune.lora_dropout=0.2"]
CELLS = {"train softcap": SOFTCAP, "bytes softcap": SOFTCAP, "train dropout": DROPOUT,
         "train dropout+recompute": [*DROPOUT, "train.recompute=full"], "masks": ["model.dropout=0.5"],
         "masks sp": ["model.dropout=0.5", "parallel.sequence_parallel=true"], "mean": DROPOUT,
         "train lora-dropout": LORA}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("tp-refusals"), 2, CELLS, WORKER)


def test_a_soft_capped_head_trains_as_one_process_and_saves_as_planned(ranks):
    reference = one_process(1, SOFTCAP)
    assert_trains_as_one_process("softcap", ranks["train softcap"][0], reference)
    uncapped = one_process(1, [])["losses"]
    assert abs(uncapped[0] - reference["losses"][0]) > 1e-2  # the cap is not a no-op here
    plan = planned(["parallel.tp=2", *SOFTCAP], 2)
    assert plan["saved"] > planned(["parallel.tp=2"], 2)["saved"]  # tanh keeps its output: V/tp per token
    for rank, measured in enumerate(ranks["bytes softcap"]):
        assert measured == plan, rank


def test_dropout_on_replicated_activations_draws_the_same_mask_on_every_tp_rank(ranks):
    first, second = ranks["train dropout"]
    assert first["losses"] == second["losses"]
    whole = [name for name in first["model"] if "norm" in name]
    assert len(whole) == 2 * 2 + 1  # two gains a block and the final one: held whole on every rank
    for name in first["model"]:
        assert torch.equal(first["model"][name], second["model"][name]), name
    # recomputation reruns each forward under the restored generator: the same masks, bit for bit
    recomputed = ranks["train dropout+recompute"][0]
    assert recomputed["losses"] == first["losses"]
    for name, grad in first["grads"].items():
        assert torch.equal(recomputed["grads"][name], grad), name


@pytest.mark.parametrize("cell", ["masks", "masks sp"])
def test_dropout_inside_a_region_draws_a_mask_of_each_tp_rank(ranks, cell):
    first, second = ranks[cell]
    assert first["kind"] == "TensorRankRng"
    assert not torch.equal(first["wrapped"]["first"], first["no_dropout"])  # p = 0.5: it drops
    # the bare core, on the shared generator, draws the same mask on both ranks; the wrapped one does not
    assert torch.equal(first["bare"]["first"], second["bare"]["first"])
    assert not torch.allclose(first["wrapped"]["first"], second["wrapped"]["first"])
    for rank in (first, second):  # the same generator state: the same mask (recomputation reruns it)
        assert torch.equal(rank["wrapped"]["first"], rank["wrapped"]["again"])
    assert torch.equal(first["wrapped"]["rng_after"], second["wrapped"]["rng_after"])


def test_dropout_loss_matches_one_process_in_expectation(ranks):
    result = ranks["mean"][0]
    tp, one = result["tp"], result["one"]
    assert tp["plain"] == pytest.approx(one["plain"], rel=1e-5)  # without dropout: one process's model
    means = {k: r["draws"].mean().item() for k, r in result.items()}
    errors = {k: (r["draws"].std() / len(r["draws"]) ** 0.5).item() for k, r in result.items()}
    print({k: f"{means[k]:.4f} +- {errors[k]:.4f} (no dropout {result[k]['plain']:.4f})" for k in result})
    for k in result:
        assert means[k] - result[k]["plain"] > 8 * errors[k], k  # dropout raises a fitted model's loss
    assert abs(means["tp"] - means["one"]) <= 4 * (errors["tp"] ** 2 + errors["one"] ** 2) ** 0.5


def test_lora_dropout_masks_the_whole_input_as_one_process(ranks):
    reference = one_process(1, LORA)
    assert_trains_as_one_process("LoRA dropout", ranks["train lora-dropout"][0], reference)
    without = one_process(1, LORA[:-1])["losses"]
    assert without[-1] != pytest.approx(reference["losses"][-1], rel=1e-5)  # the masks change the run


@pytest.mark.slow  # four lmforge runs: 130-210 s on this CPU
def test_a_peft_adapter_continues_under_tp2_as_in_one_process(base, corpus_dir, tmp_path):  # noqa: F811
    """A one-process LoRA run's adapter, exported to PEFT's layout, continued two steps by one
    process and by `lmforge finetune --nproc 2 ... parallel.tp=2 --adapter`."""
    import subprocess

    from test_distributed_train import env, losses

    data = ["--base", str(base[0]), f"data.source={corpus_dir}"]
    targets = "finetune.lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    # lr 1e-2 (not settings' 1e-3): adapters large enough that a wrong slice of one moves the losses
    finetune(tmp_path, *data, "--lora-rank", "4", targets, *settings(4), "optim.lr=1e-2", "--out", "first")
    subprocess.run([sys.executable, "-m", "lmforge", "export", "first", "--format", "peft", "--out", "adapter"],
                   cwd=tmp_path, check=True, capture_output=True, env=env(), timeout=120)
    run = [*data, "--adapter", "adapter", *settings(4, max_steps=2)]
    finetune(tmp_path, *run, "--out", "one")
    finetune(tmp_path, "--nproc", "2", *run, "parallel.tp=2", "--out", "tp")
    assert_same_runs(tmp_path / "tp", tmp_path / "one")
    assert losses(tmp_path / "one")[0][1] < losses(tmp_path / "first")[0][1] - 1e-2  # the adapter was read
