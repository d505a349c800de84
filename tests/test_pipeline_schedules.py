"""Pipeline parallelism without processes: the schedules as action lists, the layout of ranks, the
stage cut, and the settings refused before anything runs (the runs are in test_pipeline.py)."""

import re

import pytest
import torch

from lmforge.accounting.pipeline import balanced_split, bubble_fraction, micro_batches_in_flight, stage_costs
from lmforge.config import make_config
from lmforge.common.errors import LmforgeError
from lmforge.model.transformer import Transformer
from lmforge.parallel.pipeline.layout import PipelineLayout, cut_stage
from lmforge.parallel.pipeline.schedules import Action, gpipe, one_f_one_b, peak_in_flight
from lmforge.parallel.world import check_launch


def test_1f1b_is_warm_up_then_one_forward_one_backward_then_cool_down():
    # Narayanan et al. 2021, figure 4 (top): 4 stages, 8 micro-batches
    assert repr(one_f_one_b(4, 8, 0)) == "[F0, F1, F2, F3, B0, F4, B1, F5, B2, F6, B3, F7, B4, B5, B6, B7]"
    assert repr(one_f_one_b(4, 8, 3)) == "[F0, B0, F1, B1, F2, B2, F3, B3, F4, B4, F5, B5, F6, B6, F7, B7]"
    assert repr(gpipe(4, 3, 1)) == "[F0, F1, F2, B0, B1, B2]"
    # fewer micro-batches than stages: 1F1B has no steady state and is GPipe
    assert one_f_one_b(4, 2, 0) == gpipe(4, 2, 0)


@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 5), (4, 4), (4, 9), (3, 16)])
def test_every_micro_batch_runs_forward_then_backward_once_and_the_peak_matches_the_formula(stages, micro_batches):
    for stage in range(stages):
        for name, schedule in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
            actions = schedule(stages, micro_batches, stage)
            assert sorted(actions) == sorted([Action("F", i) for i in range(micro_batches)]
                                             + [Action("B", i) for i in range(micro_batches)])
            assert all(actions.index(Action("F", i)) < actions.index(Action("B", i)) for i in range(micro_batches))
            # backwards in micro-batch order: gradients sum in the order of one process accumulating
            assert [a.micro for a in actions if a.kind == "B"] == list(range(micro_batches))
            assert peak_in_flight(actions) == micro_batches_in_flight(name, stages, micro_batches, stage)


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(2, 1) == pytest.approx(1 / 2)
    assert bubble_fraction(1, 8) == 0


def test_ranks_are_laid_out_stages_outermost_as_the_mesh():
    # parallel/mesh.py's (pp, dp, tp) order: rank = (stage * replicas + replica) * tp + tp_rank
    layouts = [PipelineLayout.of(rank, 4, 2) for rank in range(4)]
    assert [(l.stage, l.replica) for l in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[3].rank_of(0) == 1 and layouts[1].last is False and layouts[2].last
    # 2 stages x 2 replicas x tp 2: tensor rank t of a stage sends to tensor rank t of the next
    layouts = [PipelineLayout.of(rank, 8, 2, tp=2) for rank in range(8)]
    assert [(l.stage, l.replica, l.tp_rank) for l in layouts] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [l.rank_of(1) for l in layouts[:4]] == [4, 5, 6, 7] and layouts[7].rank_of(0) == 3


def test_the_balanced_split_gives_the_head_stage_fewer_layers_and_beats_an_even_one():
    cfg = make_config("small").model  # 6 layers, a 4096-token head as costly as about one block
    split = balanced_split(cfg, 2, 256)
    assert sum(split) == 6 and split[-1] < split[0]
    assert max(stage_costs(cfg, 256, split)) < max(stage_costs(cfg, 256, [3, 3]))


def test_a_stage_keeps_its_layers_under_the_whole_models_names():
    cfg = make_config("tiny", overrides=["model.n_layers=4"]).model
    torch.manual_seed(0)
    whole = Transformer(cfg).state_dict()
    torch.manual_seed(0)
    first = cut_stage(Transformer(cfg), range(0, 2), first=True, last=False)
    torch.manual_seed(0)
    last = cut_stage(Transformer(cfg), range(2, 4), first=False, last=True)
    assert set(first.state_dict()) == {n for n in whole if n.startswith(("tok_embeddings", "blocks.0.", "blocks.1."))}
    assert set(last.state_dict()) == {n for n in whole if n.startswith(("blocks.2.", "blocks.3.", "norm.", "lm_head."))}
    assert all(torch.equal(t, whole[n]) for n, t in [*first.state_dict().items(), *last.state_dict().items()])
    # a middle stage takes hidden states and returns them
    hidden = torch.randn(2, 8, cfg.d_model)
    assert first(torch.zeros(2, 8, dtype=torch.long)).shape == hidden.shape
    assert last(hidden).shape == (2, 8, cfg.vocab_size)


@pytest.mark.parametrize("overrides,world_size,message", [
    (["parallel.pp=2"], 3, "needs one process per stage (or a multiple of 2"),
    (["parallel.pp=2"], 4, "2 stages x 2 replicas: choose how each stage's replicas share"),
])
def test_a_pipeline_that_cannot_run_is_refused_with_one_line(overrides, world_size, message):
    with pytest.raises(LmforgeError, match=re.escape(message)):
        check_launch(make_config("tiny", overrides=overrides), (0, world_size, 0), cuda_devices=0)


def test_a_pipeline_without_torchrun_is_refused():
    with pytest.raises(LmforgeError, match="needs one process per stage: launch with torchrun --nproc_per_node=2"):
        check_launch(make_config("tiny", overrides=["parallel.pp=2"]), None, 0)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.pp=3"], "parallel.pp=3 but the model has 2 layers"),
    (["parallel.pp=2", "train.pipeline_split=2,1"], "must give each of the 2 stages at least one layer"),
    (["parallel.pp=2", "train.pipeline_split=a,b"], "is not a list of layer counts"),
    (["train.micro_batches=4"], "applies to pipelines"),
    (["parallel.pp=2", "train.grad_accum=2"], "set train.micro_batches instead"),
    (["train.schedule=zb"], "train.schedule must be one of gpipe, 1f1b"),
])
def test_pipeline_settings_that_do_not_fit_the_model_are_refused_by_the_config(overrides, message):
    with pytest.raises(LmforgeError, match=message):
        make_config("tiny", overrides=overrides)
