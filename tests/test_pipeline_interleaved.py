"""Interleaved 1F1B without processes (the runs are in test_pipeline_interleaved_dist.py): the
action lists played out on p simulated ranks (every action once, its dependencies met, no
deadlock, the step's length against the formula), the round-robin layout and the chunk views, the
accounting, and the settings refused before anything runs."""

import itertools
import re

import pytest
import torch

from lmforge.accounting.pipeline import (bubble_fraction, chunks_in_flight, micro_batches_in_flight, rank_chunks,
                                         virtual_split)
from lmforge.accounting.measure import measure_saved_bytes, model_state_bytes_measured
from lmforge.accounting.plan.make import Costing, make_plan
from tests.plan_configs import config_of
from lmforge.cli import main
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.parallel.pipeline.layout import PipelineLayout, chunk_views, cut_stage, pipeline_place
from lmforge.parallel.pipeline.schedules import Action, interleaved_1f1b, one_f_one_b, peak_in_flight, schedule_actions


def play(schedule: str, p: int, m: int, v: int, forward: float, backward: float, latency: float = 0.0,
         actions: list | None = None):
    """Run every rank's action list (`schedule`'s, or `actions` by rank) in order as the engine
    does (a recv blocks, a send does not; a message arrives `latency` after its sender finished):
    returns (the step's length, the most (micro-batch, chunk) pairs alive on each rank). Raises on
    a deadlock (no rank can go on) and on a backward before its forward on the same rank."""
    queues = [list(actions[s] if actions else schedule_actions(schedule, p, m, s, v)) for s in range(p)]
    done: dict = {}  # (virtual stage, kind, micro) -> the time it finished
    free, alive, most = [0.0] * p, [0] * p, [0] * p
    last = p * v - 1
    while any(queues):
        moved = False
        for s in range(p):
            if not queues[s]:
                continue
            kind, i, c = queues[s][0]
            here = c * p + s
            if kind == "B" and (here, "F", i) not in done:
                raise AssertionError(f"rank {s} runs B{i}c{c} before its forward")
            needs = (here - 1, "F", i) if kind == "F" and here > 0 else \
                (here + 1, "B", i) if kind == "B" and here < last else None
            if needs is not None and needs not in done:
                continue  # blocked in a recv
            start = max(free[s], done[needs] + latency if needs else 0.0)
            free[s] = done[here, kind, i] = start + (forward if kind == "F" else backward)
            alive[s] += 1 if kind == "F" else -1
            most[s] = max(most[s], alive[s])
            queues[s].pop(0)
            moved = True
        if not moved:
            raise AssertionError(f"deadlock: every rank waits ({[q[0] for q in queues if q]})")
    return max(free), most


def test_interleaved_is_megatrons_figure_4_bottom():
    # Narayanan et al. 2021, figure 4 (bottom): 4 devices, 8 micro-batches, 2 chunks; device 1 (rank 0)
    # runs micro-batches 1-4 through chunk 1, 1-4 through chunk 2, 5-7, then the first backward (chunk 2)
    assert repr(interleaved_1f1b(4, 8, 0, 2)[:13]) == \
        "[F0, F1, F2, F3, F0c1, F1c1, F2c1, F3c1, F4, F5, F6, B0c1, F7]"
    assert repr(interleaved_1f1b(2, 2, 1, 2)) == "[F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]"


@pytest.mark.parametrize("p,v,rounds", list(itertools.product((2, 3, 4), (1, 2, 3), (1, 2, 3))))
def test_every_action_runs_once_in_dependency_order_without_deadlock(p, v, rounds):
    m = rounds * p
    for s in range(p):
        actions = interleaved_1f1b(p, m, s, v)
        every = [Action(kind, i, c) for kind in "FB" for i in range(m) for c in range(v)]
        assert sorted(actions) == sorted(every)
        # backwards in micro-batch order on each chunk: gradients sum as one process accumulating them
        for c in range(v):
            assert [a.micro for a in actions if a.kind == "B" and a.chunk == c] == list(range(m))
        assert peak_in_flight(actions) == chunks_in_flight("interleaved-1f1b", p, m, s, v)
    # unit forward, double backward per chunk of 1/v of the layers: (v m + p - 1) chunk slots
    length, most = play("interleaved-1f1b", p, m, v, 1.0 / v, 2.0 / v)
    assert length == pytest.approx((v * m + p - 1) * 3.0 / v, abs=1e-9)
    assert 1 - m * 3.0 / length == pytest.approx(bubble_fraction(p, m, v), abs=1e-9)
    assert most == [chunks_in_flight("interleaved-1f1b", p, m, s, v) for s in range(p)]


def test_the_bubble_shrinks_v_fold_and_v_1_is_1f1bs():
    p, m = 4, 8
    ideal = m * 3.0
    for v in (1, 2, 4):
        length, _ = play("interleaved-1f1b", p, m, v, 1.0 / v, 2.0 / v)
        assert (length - ideal) / ideal == pytest.approx((p - 1) / (v * m))  # the paper's (p-1)/(v m)
    assert all(bubble_fraction(p, m, 1) == bubble_fraction(p, m) for p in range(1, 9) for m in range(1, 17))
    one_chunk, _ = play("1f1b", p, m, 1, 1.0, 2.0)
    assert one_chunk == play("interleaved-1f1b", p, m, 1, 1.0, 2.0)[0]


def test_megatrons_longer_warm_up_hides_communication_latency():
    """With 1F1B's warm-up per chunk (p - s, not 2 (p - s - 1) + 1) the schedule is as short when
    messages are free but stretches when they take time: why the schedule keeps Megatron's."""
    p, m, v, latency = 4, 8, 2, 0.1
    ours, _ = play("interleaved-1f1b", p, m, v, 0.5, 1.0, latency)
    # the shorter warm-up, built from the same order of forwards and backwards
    lean = [_with_warmup(p, m, s, v, (p - s - 1) + (v - 1) * p + 1) for s in range(p)]
    assert play("", p, m, v, 0.5, 1.0, 0.0, lean)[0] == play("interleaved-1f1b", p, m, v, 0.5, 1.0)[0]
    theirs, _ = play("", p, m, v, 0.5, 1.0, latency, lean)
    assert ours < theirs


def _with_warmup(p: int, m: int, s: int, v: int, warmup: int) -> list[Action]:
    forwards = [a for a in interleaved_1f1b(p, m, s, v) if a.kind == "F"]
    backwards = [a for a in interleaved_1f1b(p, m, s, v) if a.kind == "B"]
    actions = forwards[:warmup]
    for k in range(m * v - warmup):
        actions += [backwards[k], forwards[warmup + k]]
    return actions + backwards[m * v - warmup:]


def test_activations_in_flight_on_the_first_rank_are_p_plus_p_minus_1_over_v_micro_batches():
    p, m = 4, 16
    assert [micro_batches_in_flight("1f1b", p, m, s) for s in range(p)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight("interleaved-1f1b", p, m, s, 2) for s in range(p)] == [5.5, 4.5, 3.5, 2.5]
    assert micro_batches_in_flight("interleaved-1f1b", p, m, 0, 4) == p + (p - 1) / 4
    assert micro_batches_in_flight("interleaved-1f1b", 2, 2, 0, 2) == 2  # capped: every chunk of every micro-batch


def test_rank_s_holds_chunks_s_s_plus_p_round_robin():
    cfg = make_config("tiny", overrides=["model.n_layers=8", "parallel.pp=2", "train.micro_batches=2",
                                         "train.schedule=interleaved-1f1b", "train.pipeline_virtual_stages=2"])
    split = virtual_split(cfg.model, 2, 2, "", cfg.seq_len)
    assert split == [2, 2, 2, 2]
    assert rank_chunks(split, 2, 0) == [range(0, 2), range(4, 6)]
    assert rank_chunks(split, 2, 1) == [range(2, 4), range(6, 8)]
    layout, layers = pipeline_place(cfg, 1, 2)
    assert layout.chunks == 2 and layers == [2, 3, 6, 7]
    assert [layout.virtual_stage(c) for c in range(2)] == [1, 3] and layout.gives_loss(1) and not layout.gives_loss(0)
    assert layout.rank_of_virtual(2) == 0 and layout.rank_of_virtual(3) == 1
    assert PipelineLayout.of(1, 4, 2, 2).rank_of_virtual(1) == 3  # replica 1's rank of virtual stage 1


def test_chunk_views_run_the_whole_model_in_virtual_stage_order():
    """Rank 0's and rank 1's chunks (p = 2, v = 2), run 0 -> 1 -> 2 -> 3, give one model's loss
    exactly: the same modules in the same order. The views share the rank model's parameters."""
    cfg = make_config("tiny", overrides=["model.n_layers=4"]).model
    torch.manual_seed(0)
    whole = Transformer(cfg)
    ranks = []
    for stage in (0, 1):
        torch.manual_seed(0)
        layout = PipelineLayout.of(stage, 2, 2, 2)
        layers = [layer for chunk in rank_chunks([1, 1, 1, 1], 2, stage) for layer in chunk]
        model = cut_stage(Transformer(cfg), layers, layout.first, layout.last)
        ranks.append((model, chunk_views(model, layout)))
    (rank0, (c0, c2)), (rank1, (c1, c3)) = ranks
    assert list(rank0.blocks.keys()) == ["0", "2"] and list(c2.blocks.keys()) == ["2"]
    assert c0.tok_embeddings is rank0.tok_embeddings and c2.tok_embeddings is None and c1.lm_head is None
    assert {id(p) for view in (c0, c2) for p in view.parameters()} == {id(p) for p in rank0.parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(c3(c2(c1(c0(tokens))), targets), whole(tokens, targets))
    assert list(rank0.state_dict()) == [n for n in whole.state_dict() if not n.startswith(
        ("blocks.1.", "blocks.3.", "norm.", "lm_head."))]


@pytest.mark.parametrize("overrides,message", [
    (["train.pipeline_virtual_stages=3", "model.n_layers=4"], "cuts the model.n_layers=4 layers into 2 stages x 3 "
                                                              "virtual stages = 6 equal chunks"),
    (["train.pipeline_virtual_stages=2", "model.n_layers=4", "train.micro_batches=3"],
     "train.micro_batches=3 must be a multiple of 2"),
    (["train.pipeline_virtual_stages=2", "model.n_layers=4", "train.pipeline_split=1,3"],
     "its chunks are equal; leave it unset"),
])
def test_interleaved_settings_that_do_not_fit_are_refused_in_one_line(overrides, message):
    base = ["parallel.pp=2", "train.micro_batches=2", "train.schedule=interleaved-1f1b"]
    with pytest.raises(LmforgeError, match=re.escape(message)):
        make_config("tiny", overrides=base + overrides)


def test_virtual_stages_without_the_interleaved_schedule_are_refused():
    with pytest.raises(LmforgeError, match="train.pipeline_virtual_stages=2 applies to train.schedule=interleaved-1f1b"):
        make_config("tiny", overrides=["parallel.pp=2", "train.pipeline_virtual_stages=2"])
    with pytest.raises(LmforgeError, match="train.pipeline_virtual_stages must be"):
        make_config("tiny", overrides=["parallel.pp=2", "train.schedule=interleaved-1f1b",
                                       "train.pipeline_virtual_stages=0"])


def test_one_f_one_b_is_unchanged_by_the_chunk_field():
    assert one_f_one_b(4, 8, 0) == [Action("F", 0), Action("F", 1), Action("F", 2), Action("F", 3), Action("B", 0),
                                    Action("F", 4), Action("B", 1), Action("F", 5), Action("B", 2), Action("F", 6),
                                    Action("B", 3), Action("F", 7), Action("B", 4), Action("B", 5), Action("B", 6),
                                    Action("B", 7)]


# -- the plan ----------------------------------------------------------------------------------------

def interleaved_plan(cfg, v: int, m: int = 8, b: int = 3, s: int = 48, p: int = 2, schedule="interleaved-1f1b"):
    run = config_of(cfg, f"train.batch_size={b}", f"train.seq_len={s}", f"parallel.pp={p}",
                    f"train.micro_batches={m}", f"train.schedule={schedule}", f"train.pipeline_virtual_stages={v}")
    return make_plan(run, Costing(hardware="h100-sxm"))["pipeline"]


def test_the_plans_stages_hold_and_save_what_their_chunks_do():
    """Each rank's parameters, AdamW's states and the activations one micro-batch saves through
    its chunks, planned, against the rank's model cut and run chunk by chunk (measured with the
    saved-tensor hooks; within 8 bytes, the loss's scalar, as test_pipeline_accounting.py)."""
    cfg = make_config("tiny", overrides=["model.n_layers=4"]).model
    piped = interleaved_plan(cfg, 2)
    assert piped["split"] == [1, 1, 1, 1] and piped["split_source"] == "interleaved"
    b, s = 3, 48
    for stage, planned in enumerate(piped["stages_detail"]):
        layout = PipelineLayout.of(stage, 2, 2, 2)
        layers = [layer for chunk in rank_chunks(piped["split"], 2, stage) for layer in chunk]
        assert planned["chunk_layers"] == [[layers[0], layers[0]], [layers[1], layers[1]]]
        torch.manual_seed(0)
        model = cut_stage(Transformer(cfg), layers, layout.first, layout.last)
        optimizer = AdamW(model.parameters(), lr=1e-3)
        saved = 0
        for c, chunk in enumerate(chunk_views(model, layout)):
            x = torch.randint(0, cfg.vocab_size, (b, s)) if layout.takes_tokens(c) else \
                torch.randn(b, s, cfg.d_model, requires_grad=True)
            with measure_saved_bytes(model.parameters()) as measured:
                out = chunk(x, torch.randint(0, cfg.vocab_size, (b, s)) if layout.gives_loss(c) else None)
            out.float().sum().backward()
            saved += measured.activations
        optimizer.step()
        states = model_state_bytes_measured(model, optimizer)
        assert states == {key: planned["breakdown_bytes"][key] for key in states}, stage
        assert planned["parameter_count"] == sum(p.numel() for p in model.parameters())
        assert abs(planned["activations_per_micro_batch_bytes"] - saved) <= 8, stage
        assert planned["chunks_in_flight"] == chunks_in_flight("interleaved-1f1b", 2, 8, stage, 2)


def test_the_plans_bubble_step_and_traffic_for_v_chunks():
    cfg = make_config("tiny", overrides=["model.n_layers=8", "model.tie_embeddings=false"]).model
    one = interleaved_plan(cfg, 1, schedule="1f1b")
    for v in (1, 2, 4):
        piped = interleaved_plan(cfg, v)
        assert piped["bubble_fraction"] == bubble_fraction(2, 8, v) == 1 / (8 * v + 1)
        first, last = piped["stages_detail"]
        sent, sent_1f1b = first["sent_bytes_per_step"], one["stages_detail"][0]["sent_bytes_per_step"]
        # a micro-batch leaves each of rank 0's v chunks, and comes back to all but its first
        assert sent["activations"] == v * sent_1f1b["activations"]
        assert sent["activation_gradients"] == (v - 1) * last["sent_bytes_per_step"]["activation_gradients"] / v
        assert piped["seconds_per_step"] == pytest.approx((8 + 1 / v) * max(
            d["seconds_per_micro_batch"] for d in piped["stages_detail"]))
    v1 = interleaved_plan(cfg, 1)
    assert v1["bubble_fraction"] == one["bubble_fraction"] and v1["seconds_per_step"] == one["seconds_per_step"]


def test_lmforge_plan_prints_the_interleaved_pipeline(capsys):
    main(["plan", "--model", "tiny", "model.n_layers=8", "--pp", "4", "train.micro_batches=8",
          "train.schedule=interleaved-1f1b", "train.pipeline_virtual_stages=2"])
    out = capsys.readouterr().out
    assert "interleaved-1f1b, 8 micro-batches, 2 chunks per stage" in out
    assert "(p - 1) / (v m + p - 1) = 3/19" in out
    assert " 0,4 " in out and "x 5.5" in out  # rank 0 holds layers 0 and 4, 11 chunks = 5.5 micro-batches


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2),
                                             ("interleaved-1f1b", 3)])
def test_two_ranks_send_their_messages_in_the_order_the_receiver_takes_them(schedule, chunks):
    """The engine tags each message (micro-batch, chunk, direction), so gloo matches them by name;
    a backend that ignores tags (NCCL) matches a pair of ranks' messages in order, which the
    schedules also get right: for every (sender, receiver), the sender's sends in its action order
    are the receiver's recvs in its own (with p = 2 interleaved, activations and gradients mixed)."""
    for p, rounds in itertools.product((2, 3, 4), (1, 2, 3)):
        m, last = rounds * p, p * chunks - 1
        sent: dict = {}
        taken: dict = {}
        for s in range(p):
            for kind, i, c in schedule_actions(schedule, p, m, s, chunks):
                here = c * p + s
                ahead, behind = (here + 1, here - 1) if kind == "F" else (here - 1, here + 1)
                if (here > 0) if kind == "F" else (here < last):  # received from behind
                    taken.setdefault((behind % p, s), []).append((kind, i, here))
                if (here < last) if kind == "F" else (here > 0):  # sent ahead
                    sent.setdefault((s, ahead % p), []).append((kind, i, ahead))
        assert sent == taken, (p, m)
