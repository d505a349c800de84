"""Muon (optim/muon.py) against torch.optim.Muon, its split of the model, and its resume by name."""

import pytest
import torch

from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.optim.muon import Muon, muon_param_groups, orthogonalize, orthogonalize_all

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


def test_matrices_of_one_shape_are_orthogonalized_in_one_batch_bit_for_bit():
    """orthogonalize_all stacks the matrices of each shape (tall ones transposed as copies) and
    runs one batched iteration per shape: each result equals the 2-D path's bit for bit, in the
    list's order, shapes interleaved and one shape alone included."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(48, 16), (16, 48), (24, 24), (48, 16), (24, 24), (48, 16), (16, 48), (8, 40)]
    updates = [torch.randn(shape, generator=generator) for shape in shapes]
    batched = orthogonalize_all(updates)
    assert [tuple(o.shape) for o in batched] == shapes
    for update, ortho in zip(updates, batched):
        assert torch.equal(ortho, orthogonalize(update))
    assert not torch.equal(batched[0], batched[3])  # each matrix its own, not the stack's first


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
    """parallel/world.py's one launch check, before any process group exists; ZeRO takes Muon."""
    from lmforge.common.errors import LmforgeError
    from lmforge.parallel.world import check_launch

    cfg = make_config("tiny", overrides=[f"optim.name={name}", f"train.parallel={strategy}", "train.device=cpu"])
    with pytest.raises(LmforgeError, match=why):
        check_launch(cfg, (0, 2, 0), cuda_devices=0)
    ok = make_config("tiny", overrides=["optim.name=muon", "train.parallel=zero3", "train.device=cpu"])
    assert check_launch(ok, (0, 2, 0), cuda_devices=0) == torch.device("cpu")


def test_tensor_parallelism_takes_muon_under_none_and_ddp_and_refuses_adafactor():
    """Muon gathers each split matrix over tp (parallel/tp_engine.py), where the optimizer holds
    whole tp slices; Adafactor's factored moment is refused (tests/test_tp.py has the rest)."""
    from lmforge.common.errors import LmforgeError
    from lmforge.parallel.world import check_launch

    def cfg(name, strategy):
        return make_config("tiny", overrides=[f"optim.name={name}", "parallel.tp=2", f"train.parallel={strategy}",
                                              "train.sample_tokens=0", "train.device=cpu"])
    assert check_launch(cfg("muon", "none"), (0, 2, 0), cuda_devices=0) == torch.device("cpu")
    assert check_launch(cfg("muon", "ddp"), (0, 4, 0), cuda_devices=0) == torch.device("cpu")
    with pytest.raises(LmforgeError, match="muon does not combine with parallel.tp=2 and train.parallel=zero1"):
        check_launch(cfg("muon", "zero1"), (0, 4, 0), cuda_devices=0)
    with pytest.raises(LmforgeError, match="optim.name=adafactor does not combine with parallel.tp=2"):
        check_launch(cfg("adafactor", "none"), (0, 2, 0), cuda_devices=0)


def lora_run(name: str, steps: int = 4):
    """The tiny model with LoRA adapters (rank 4), `steps` steps of optim.name=`name` on real
    gradients: (the model, its optimizer, its config, its policy)."""
    from lmforge.modes import get_policy
    from lmforge.train.setup import build_model, build_optimizer

    cfg = make_config("tiny", overrides=[f"optim.name={name}", "finetune.lora_rank=4"])
    policy = get_policy("fp32")
    torch.manual_seed(0)
    model = build_model(cfg, policy)
    optimizer = build_optimizer(cfg, policy, model)
    tokens = torch.randint(0, cfg.model.vocab_size, (steps, 2, 17), generator=torch.Generator().manual_seed(1))
    for batch in tokens:
        model.zero_grad()
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
    return model, optimizer, cfg, policy


def test_with_lora_muon_leaves_the_adapters_to_adamw():
    """LoRA's A (r x in) and B (out x r) are factors of an update, not hidden maps (optim/muon.py
    says why Muon does not orthogonalise them): every adapter is in an AdamW group, so Muon with
    LoRA trains as AdamW with LoRA, bit for bit, and holds AdamW's two states per adapter element,
    as the plan counts them (memory.model_state_bytes with lora_trainable)."""
    from lmforge.accounting.measure import model_state_bytes_measured
    from lmforge.accounting.memory import model_state_bytes

    model, optimizer, cfg, policy = lora_run("muon")
    adamw_model, _, _, _ = lora_run("adamw")
    groups = optimizer.param_groups
    assert groups[0]["use_muon"] and groups[0]["params"] == []
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    for (name, p), q in zip(model.named_parameters(), adamw_model.parameters()):
        assert torch.equal(p, q), name
    assert {k for state in optimizer.state.values() for k in state} == {"step", "exp_avg", "exp_avg_sq"}
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    planned = model_state_bytes(cfg.model, policy, "muon", lora_trainable=adapters)["optimizer_states"]
    assert model_state_bytes_measured(model, optimizer)["optimizer_states"] == planned == 2 * 4 * adapters


@pytest.mark.parametrize("tied", [True, False])
def test_a_pipeline_stages_muon_states_are_its_share_of_the_models(tied):
    """The plan counts Muon's states per stage from each stage's hidden matrices (accounting/
    pipeline.py): the stages' sum is the whole model's, plus (tied) the embedding's AdamW states
    once more (the last stage holds its copy), and each stage's are its own parameters' measured
    in one process (a momentum per block matrix element, AdamW's two for the rest)."""
    from lmforge.accounting.memory import optimizer_state_bytes
    from lmforge.accounting.pipeline import stage_parameters

    cfg = make_config("tiny", overrides=[f"model.tie_embeddings={str(tied).lower()}"]).model
    stages = stage_parameters(cfg, [1, 1])
    per_stage = [optimizer_state_bytes(cfg, "muon", parameter_shapes=s.shapes, hidden_matrices=s.hidden_matrices)
                 for s in stages]
    model = Transformer(cfg)
    extra = 2 * 4 * model.tok_embeddings.weight.numel() if tied else 0
    assert sum(per_stage) == optimizer_state_bytes(cfg, "muon") + extra
    named = list(model.named_parameters(remove_duplicate=False))  # the tied matrix under both names
    for stage, s in enumerate(stages):
        ends = ("tok_", "pos_") if stage == 0 else ("norm.", "lm_head.")
        mine = {p: n for n, p in named if n.startswith((f"blocks.{stage}.", *ends))}
        muon = sum(p.numel() for p, n in mine.items() if p.ndim == 2 and n.startswith("blocks."))
        assert s.hidden_matrices == muon > 0
        assert per_stage[stage] == 4 * (muon + 2 * (sum(p.numel() for p in mine) - muon))
    with pytest.raises(ValueError, match="need its hidden_matrices"):
        optimizer_state_bytes(cfg, "muon", parameter_shapes=stages[0].shapes)


def test_bad_muon_settings_are_one_line():
    from lmforge.common.errors import LmforgeError

    for override, message in [("optim.name=muonn", "did you mean .muon."),
                              ("optim.muon_adjust_lr=spectral", "use original or match_rms_adamw"),
                              ("optim.muon_momentum=1.0", r"must be in \[0, 1\)")]:
        with pytest.raises(LmforgeError, match=message):
            make_config("tiny", overrides=[override])


def test_the_plan_counts_muons_zero_gather_where_the_engine_runs_it():
    """parallel/whole_matrices.py's all-gather: each block unit at its padded size, in the master
    dtype, once a step, under ZeRO only (DDP keeps whole matrices; LoRA's adapters are AdamW's).
    Measured equal to the engine's count in tests/test_optimizers_dist.py."""
    from lmforge.accounting.comm import step_communication, unit_sizes
    from lmforge.modes import get_policy

    cfg = make_config("tiny").model
    blocks = sum(-(-n // 3) * 3 for unit, n in unit_sizes(cfg).items() if unit.startswith("blocks."))
    for strategy in ("zero1", "zero2", "zero3"):
        for precision, size in (("fp32", 4), ("bf16-mixed", 4), ("bf16-pure", 2)):
            muon = step_communication(cfg, strategy, 3, get_policy(precision), optimizer="muon")
            adamw = step_communication(cfg, strategy, 3, get_policy(precision))
            assert muon["optimizer_sent_bytes"] == blocks * size * 2 / 3
            assert muon["sent_bytes"] == adamw["sent_bytes"] + muon["optimizer_sent_bytes"]
    assert step_communication(cfg, "ddp", 3, optimizer="muon")["optimizer_sent_bytes"] == 0
    assert step_communication(cfg, "zero1", 3, optimizer="muon", lora=(4, "q_proj,v_proj"))["optimizer_sent_bytes"] == 0
    assert step_communication(cfg, "zero1", 3, optimizer="adamw")["optimizer_sent_bytes"] == 0
