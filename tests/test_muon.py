"""Muon (optim/muon.py) against torch.optim.Muon, its split of the model, and its resume by name."""

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.optim.muon import Muon, muon_param_groups, orthogonalize

# tall (MLP up), wide (MLP down) and square (attention) matrices, as in a block
SHAPES = [(48, 16), (16, 48), (24, 24)]


def matrices(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in SHAPES]


def gradients(params, step: int) -> list[torch.Tensor]:
    """The step's gradients: noise plus a pull toward zero (the gradient of a weight penalty), so
    that they depend on where the parameters are, as a real loss's do."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator) + 0.5 * p.detach() for p in params]


@pytest.mark.parametrize("nesterov, adjust", [(True, "original"), (False, "original"), (True, "match_rms_adamw")])
def test_200_steps_are_torchs_muon_bit_for_bit(nesterov, adjust):
    """The same operations in the same order (momentum lerps, Newton-Schulz in bf16 by addmm, the
    decay, the adjusted step), so on the CPU no tolerance is needed: bf16 rounds the same way in
    both. Each step both optimizers get the same gradient, a function of their (equal) parameters."""
    ours, theirs = matrices(), matrices()
    mine = Muon([{"params": ours, "use_muon": True}], lr=0.02, weight_decay=0.1, momentum=0.95,
                nesterov=nesterov, adjust_lr=adjust)
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                 adjust_lr_fn=adjust)
    for step in range(200):
        for p, q, g in zip(ours, theirs, gradients(ours, step)):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(mine.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"])
    assert not torch.equal(ours[0], matrices()[0])  # it moved


def test_newton_schulz_brings_singular_values_near_one():
    """Jordan's quintic does not converge to exactly 1: after 5 steps the singular values of a
    matrix whose own spread over a factor of ~130 end in about [0.68, 1.2] (the post: 'something
    like U S' V^T, S' ~ Uniform(0.5, 1.5)'); tall matrices are transposed first, so both
    orientations come out alike."""
    torch.manual_seed(0)
    m = torch.randn(64, 32) @ torch.diag(torch.logspace(-2, 0, 32))
    before = torch.linalg.svdvals(m)
    assert before.max() / before.min() > 100
    for x in (m, m.T):
        s = torch.linalg.svdvals(orthogonalize(x).float())
        assert s.min() > 0.6 and s.max() < 1.3
    assert orthogonalize(m).dtype == torch.bfloat16 and orthogonalize(m).shape == m.shape


def test_the_split_on_the_tiny_model():
    """Hidden 2-D weights (attention and MLP projections) to Muon; the embedding (tied to the head),
    the head when untied, and the norms to AdamW, with decay on the 2-D ones only."""
    cfg = make_config("tiny")
    model = Transformer(cfg.model)
    names = {p: n for n, p in model.named_parameters()}
    groups = muon_param_groups(model, 0.1)
    where = [[names[p] for p in g["params"]] for g in groups]
    projections = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert where[0] == [f"blocks.{i}.{p}.weight" for i in range(cfg.model.n_layers) for p in projections]
    assert where[1] == ["tok_embeddings.weight"]
    assert where[2] == [f"blocks.{i}.{n}.weight" for i in range(cfg.model.n_layers)
                        for n in ("attn_norm", "mlp_norm")] + ["norm.weight"]
    assert [(g["use_muon"], g["weight_decay"]) for g in groups] == [(True, 0.1), (False, 0.1), (False, 0.0)]
    cfg.model.tie_embeddings = False
    untied = Transformer(cfg.model)
    names = {p: n for n, p in untied.named_parameters()}
    assert [names[p] for p in muon_param_groups(untied, 0.1)[1]["params"]] == ["tok_embeddings.weight", "lm_head.weight"]
    # the same groups, in the same order, on every build: a checkpoint resumes by name
    again = Transformer(cfg.model)
    again_names = {p: n for n, p in again.named_parameters()}
    assert [[again_names[p] for p in g["params"]] for g in muon_param_groups(again, 0.1)] == \
           [[names[p] for p in g["params"]] for g in muon_param_groups(untied, 0.1)]


def test_the_rest_is_lmforges_adamw_and_the_matrices_torchs_muon_on_the_tiny_model():
    """One Muon over the model's three groups steps as torch's Muon over the matrices plus lmforge's
    AdamW over the rest, bit for bit, over 30 steps of real gradients (the model's loss)."""
    cfg = make_config("tiny")
    torch.manual_seed(0)
    ours, theirs = Transformer(cfg.model), Transformer(cfg.model)
    theirs.load_state_dict(ours.state_dict())
    mine = Muon(muon_param_groups(ours, 0.1), lr=3e-3, lr_multiplier=0.02 / 3e-3, betas=(0.9, 0.95))
    groups = muon_param_groups(theirs, 0.1)
    reference = [torch.optim.Muon(groups[0]["params"], lr=0.02, weight_decay=0.1),
                 AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in groups[1:]], lr=3e-3,
                       betas=(0.9, 0.95))]
    tokens = torch.randint(0, cfg.model.vocab_size, (30, 2, 17), generator=torch.Generator().manual_seed(1))
    for batch in tokens:
        for model in (ours, theirs):
            model.zero_grad()
            model(batch[:, :-1], batch[:, 1:]).backward()
        mine.step()
        for optimizer in reference:
            optimizer.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), name


def test_resume_by_name_is_bit_identical(tiny_config, tmp_path, monkeypatch):
    """optim.name=muon through the trainer: killed inside step 6, resumed from the checkpoint of
    step 4, the parameters and the optimizer state end as those of the uninterrupted run, bit for bit."""
    from tests.test_checkpoint import assert_same_state_dict, parameters, quiet_trainer, run_until_killed

    cfg = tiny_config("optim.name=muon", max_steps=8, checkpoint_interval=4)
    straight = quiet_trainer(cfg, tmp_path / "straight")
    straight.run()
    run_until_killed(cfg, tmp_path / "resumed", kill_at_step=6, monkeypatch=monkeypatch)
    resumed = quiet_trainer(cfg, tmp_path / "resumed", resume=True)
    assert resumed.step == 4 and isinstance(resumed.optimizer, Muon)
    resumed.run()
    expected, actual = parameters(straight), parameters(resumed)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert_same_state_dict(straight.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    matrix = straight.model.blocks["0"].attn.q_proj.weight
    assert straight.optimizer.state[matrix].keys() == {"momentum_buffer"}


@pytest.mark.parametrize("name, strategy, why", [
    ("adafactor", "zero1", "factored by each matrix's rows and columns"),
    ("adafactor", "fsdp", "factored by each matrix's rows and columns"),
    ("muon", "fsdp", "Newton-Schulz needs whole matrices"),
])
def test_shape_needing_optimizers_are_refused_where_the_shards_lose_the_shapes(name, strategy, why):
    """parallel/launch.py's one launch check, before any process group exists; ZeRO takes Muon."""
    from lmforge.common.errors import LmforgeError
    from lmforge.parallel.launch import check_launch

    cfg = make_config("tiny", overrides=[f"optim.name={name}", f"train.parallel={strategy}", "train.device=cpu"])
    with pytest.raises(LmforgeError, match=why):
        check_launch(cfg, (0, 2, 0), cuda_devices=0)
    ok = make_config("tiny", overrides=["optim.name=muon", "train.parallel=zero3", "train.device=cpu"])
    assert check_launch(ok, (0, 2, 0), cuda_devices=0) == torch.device("cpu")


def test_whole_matrix_optimizers_are_refused_with_tensor_parallelism():
    from lmforge.common.errors import LmforgeError
    from lmforge.parallel.launch import check_launch

    for name in ("muon", "adafactor"):
        cfg = make_config("tiny", overrides=[f"optim.name={name}", "parallel.tp=2", "train.parallel=none",
                                             "train.sample_tokens=0", "train.device=cpu"])
        with pytest.raises(LmforgeError, match=f"optim.name={name} does not combine with parallel.tp=2"):
            check_launch(cfg, (0, 2, 0), cuda_devices=0)


@pytest.mark.parametrize("extra, setting", [(["train.pipeline_stages=2", "train.micro_batches=2"],
                                             "train.pipeline_stages=2"),
                                            (["finetune.lora_rank=4"], "finetune.lora_rank=4")])
def test_muon_on_a_pipeline_or_with_lora_is_refused_before_launch(extra, setting):
    """Untested, and the plan does not count Muon's states on a stage or for adapters: refused."""
    from lmforge.common.errors import LmforgeError
    from lmforge.parallel.launch import check_launch

    cfg = make_config("tiny", overrides=["optim.name=muon", "train.device=cpu", *extra])
    with pytest.raises(LmforgeError, match=f"optim.name=muon with {setting} is not supported yet"):
        check_launch(cfg, (0, 2, 0), cuda_devices=0)


def test_bad_muon_settings_are_one_line():
    from lmforge.common.errors import LmforgeError

    for override, message in [("optim.name=muonn", "did you mean .muon."),
                              ("optim.muon_adjust_lr=spectral", "use original or match_rms_adamw"),
                              ("optim.muon_momentum=1.0", r"must be in \[0, 1\)")]:
        with pytest.raises(LmforgeError, match=message):
            make_config("tiny", overrides=[override])
