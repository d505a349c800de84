"""The model's public pieces and the wrappers applied from outside (train/setup.py)."""

import copy

import pytest
import torch
import torch.nn as nn

from lmforge.config import make_config
from lmforge.model.attention import AttentionCore
from lmforge.model.transformer import Block, Transformer, cross_entropy_loss
from lmforge.precision.fp8 import Fp8Linear
from lmforge.modes import POLICIES, RECOMPUTE_MODES, get_policy
from lmforge.precision.policy import prepare_model
from lmforge.precision.policy import Fp32Attention
from lmforge.model.names import canonical_name
from lmforge.wrap import Recompute, apply_recompute
from lmforge.train.setup import build, build_model


def config(*overrides, family="llama"):
    extra = ["model.family=gpt", "model.n_kv_heads=null"] if family == "gpt" else []
    return make_config("tiny", overrides=["model.n_layers=3", *extra, *overrides])


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("precision", POLICIES)
def test_wrapped_module_tree_follows_the_documented_order(precision, recompute):
    cfg = config(f"train.precision={precision}", f"train.recompute={recompute}", "train.fp32_attention=true")
    model, optimizer = build(cfg)
    for name in map(str, range(3)):
        outer = model.blocks[name]
        # full recomputation wraps the whole block; otherwise the block is the model's own
        block = outer.wrapped if recompute == "full" else outer
        assert isinstance(outer, Recompute) == (recompute == "full")
        assert type(block) is Block
        core = block.attn.core
        if recompute == "selective":  # recomputation outside, fp32 attention inside it
            assert isinstance(core, Recompute)
            core = core.wrapped
        assert isinstance(core, Fp32Attention) and type(core.core) is AttentionCore
        linear_type = Fp8Linear if precision == "fp8" else nn.Linear
        assert type(block.attn.q_proj) is linear_type and type(block.mlp.down_proj) is linear_type
    assert type(model.lm_head) is nn.Linear  # the head is never fp8
    expected_dtype = getattr(torch, get_policy(precision).param_dtype)
    assert {p.dtype for p in model.parameters()} == {expected_dtype}
    # the optimizer holds every parameter once (the tied head and embedding are one tensor)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len(set(held)) == len(dict.fromkeys(model.parameters()))
    # the wrappers show in print(model)
    text = repr(model)
    assert "Fp32Attention" in text and ("Recompute" in text) == (recompute != "none")


def test_wrapping_twice_is_refused():
    model = build_model(config("train.precision=fp8", "train.recompute=selective"), get_policy("fp8"))
    with pytest.raises(ValueError, match="precision policy is already applied"):
        prepare_model(model, get_policy("fp8"))
    with pytest.raises(ValueError, match="recomputation is already applied"):
        apply_recompute(model, "full")
    pure = build_model(config("train.precision=bf16-pure"), get_policy("bf16-pure"))
    with pytest.raises(ValueError, match="precision policy is already applied"):
        prepare_model(pure, get_policy("bf16-pure"))


def test_meta_build_allocates_nothing_and_has_the_real_shapes():
    cfg = make_config("llama3-70b", overrides=["train.precision=bf16-mixed", "train.recompute=full"])
    model = build_model(cfg, get_policy(cfg.train.precision), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == 70_553_706_496  # the preset's published count (README table)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_recomputation_keeps_parameter_names_and_loads_plain_state(family):
    cfg = config("train.recompute=full", family=family)
    torch.manual_seed(0)
    plain = Transformer(cfg.model)
    wrapped = build_model(cfg, get_policy(cfg.train.precision))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [canonical_name(n) for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    wrapped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    torch.testing.assert_close(wrapped(tokens), plain(tokens), rtol=0, atol=0)


class Adapter(nn.Module):
    """A stand-in for a LoRA layer: a linear wrapped with a trainable low-rank update."""

    def __init__(self, base: nn.Module, rank: int = 2):
        super().__init__()
        self.base = base
        self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.down.T @ self.up.T


def wrap_projections(model: nn.Module) -> None:
    for block in model.blocks.values():
        block = block.wrapped if isinstance(block, Recompute) else block
        block.attn.q_proj = Adapter(block.attn.q_proj)


def test_wrappers_of_a_linear_compose_with_fp8_and_recomputation():
    cfg = config()
    # fp8 of an adapted layer: the base linear inside the adapter becomes fp8
    model = Transformer(cfg.model)
    wrap_projections(model)
    prepare_model(model, get_policy("fp8"))
    apply_recompute(model, "full")
    q = model.blocks["0"].wrapped.attn.q_proj
    assert type(q) is Adapter and type(q.base) is Fp8Linear
    # an adapter of an fp8 layer
    other = prepare_model(Transformer(cfg.model), get_policy("fp8"))
    wrap_projections(other)
    assert type(other.blocks["1"].attn.q_proj.base) is Fp8Linear
    for m in (model, other):  # both train: forward and backward reach the adapter's parameters
        tokens = torch.randint(0, 512, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tokens, tokens)
        loss.backward()
        adapters = [mod for mod in m.modules() if isinstance(mod, Adapter)]
        assert len(adapters) == 3 and all(a.down.grad is not None and a.down.grad.abs().sum() > 0 for a in adapters)


def cut(model: Transformer, boundaries: list[int]) -> list[Transformer]:
    """Pipeline stages from the public pieces: stage i keeps blocks [boundaries[i], boundaries[i+1]),
    the first the embedding, the last the final norm and head."""
    stages = []
    last = len(boundaries) - 2
    for index in range(last + 1):
        stage = copy.deepcopy(model)
        for name in list(stage.blocks):
            if not boundaries[index] <= int(name) < boundaries[index + 1]:
                del stage.blocks[name]
        if index > 0:
            stage.tok_embeddings = stage.pos_embeddings = None
        if index < last:
            stage.norm = stage.lm_head = None
        stages.append(stage)
    return stages


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("boundaries", [[0, 2, 4], [0, 1, 3, 4]])
def test_stages_cut_from_the_pieces_give_the_whole_models_logits_and_gradients(family, boundaries):
    cfg = config("model.n_layers=4", family=family)
    torch.manual_seed(0)
    model = Transformer(cfg.model).double()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24))
    targets = torch.randint(0, cfg.model.vocab_size, (2, 24))
    logits = model(tokens)
    cross_entropy_loss(logits, targets).backward()

    stages = cut(model, boundaries)
    # names are those of the whole model: stage 2 of [0, 1, 3, 4] holds blocks.1 and blocks.2
    assert list(stages[1].blocks) == [str(i) for i in range(boundaries[1], boundaries[2])]
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    # forward stage by stage: each stage's output is the next one's input, cut from the graph as a
    # send/receive between ranks would cut it
    inputs, outputs = [tokens], []
    for stage in stages:
        out = stage(inputs[-1])
        outputs.append(out)
        inputs.append(out.detach().requires_grad_())
    torch.testing.assert_close(outputs[-1], logits, rtol=0, atol=0)
    # backward from the last stage to the first, handing each stage the gradient of its output
    for index in reversed(range(len(stages))):
        if index == len(stages) - 1:
            cross_entropy_loss(outputs[index], targets).backward()
        else:
            outputs[index].backward(inputs[index + 1].grad)
    staged = {name: param.grad for stage in stages for name, param in stage.named_parameters()}
    # the tied matrix is two tensors once cut: its gradient is the embedding's (first stage) plus
    # the head's (last stage), summed as a pipeline must sum them between the two ranks
    staged["tok_embeddings.weight"] = staged["tok_embeddings.weight"] + staged.pop("lm_head.weight")
    for name, param in model.named_parameters():
        torch.testing.assert_close(staged[name], param.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert stages[0].cfg.tie_embeddings and stages[-1].cfg.tie_embeddings
