"""The `parallel` section's degrees (config/schema.py's Degrees, config/validate.py's resolve_degrees):
pp x dp_replicate x dp_shard x cp x tp,
parallel.pp the pipeline's stages (train.pipeline_stages its older name), dp_* resolved into
train.parallel, the product checked against the world by
the one launch check, each refusal one line before anything is written; and `lmforge plan
--dp-shard N --dp-replicate M`'s states (1/dp_shard of them) and traffic. One process, no
process group: check_launch takes the (rank, world, local rank) a launcher would give."""

import pytest
import yaml

from lmforge.accounting.comm import step_communication, unit_sizes
from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.cli import main
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.config.load import config_from_dict, load_config
from lmforge.config.schema import config_to_dict
from lmforge.config.schema import Degrees, mesh_degrees
from lmforge.parallel.world import check_launch


def config(*overrides: str):
    return make_config("tiny", overrides=["train.device=cpu", "train.sample_tokens=0", *overrides])


def launched(cfg, world: int):
    return check_launch(cfg, (0, world, 0), cuda_devices=0)


def test_pp_is_the_pipeline_stages_and_its_older_name_an_alias_that_may_not_disagree():
    assert config("parallel.pp=2").parallel.pp == 2
    assert config("train.pipeline_stages=2").parallel.pp == 2
    assert config("parallel.pp=0").parallel.pp == 1  # 0: not set, as older configs wrote it
    assert config("parallel.pp=2", "train.pipeline_stages=2").parallel.pp == 2
    with pytest.raises(LmforgeError, match=r"^parallel.pp=2 and train.pipeline_stages=3 disagree"):
        config("parallel.pp=2", "train.pipeline_stages=3")
    with pytest.raises(LmforgeError, match=r"^parallel.pp=3 and train.pipeline_stages=2 disagree"):
        config("train.pipeline_stages=2", "parallel.pp=3")
    with pytest.raises(LmforgeError, match=r"^a file: parallel.pp=2 and train.pipeline_stages=3 disagree"):
        config_from_dict({"train": {"pipeline_stages": 3}, "parallel": {"pp": 2}}, origin="a file")
    assert "pipeline_stages" not in config_to_dict(config("parallel.pp=2"))["train"]  # saved under one name


def test_an_older_runs_config_yaml_with_train_pipeline_stages_still_loads(tmp_path):
    saved = config_to_dict(config())
    for stages, pp in ((1, 0), (2, 0), (2, 2)):  # as older runs saved it: pp 0 (not set) or the same count
        old = {**saved, "train": {**saved["train"], "pipeline_stages": stages},
               "parallel": {**saved["parallel"], "pp": pp}}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
        assert load_config(tmp_path / "config.yaml").parallel.pp == stages
    # a later layer overrides an earlier one's, whichever the spelling (resuming with new degrees)
    assert make_config("tiny", tmp_path / "config.yaml", ["parallel.pp=1"]).parallel.pp == 1


def test_dp_shard_makes_the_data_ranks_shard_and_says_so(capsys):
    assert config("parallel.dp_shard=2").train.parallel == "fsdp"
    assert "train.parallel=none becomes fsdp" in capsys.readouterr().err
    assert config("parallel.dp_shard=2", "train.parallel=ddp").train.parallel == "fsdp"
    assert "train.parallel=ddp becomes fsdp" in capsys.readouterr().err
    for kept in ("zero1", "zero2", "zero3", "fsdp"):  # already sharding: kept, and nothing said
        assert config("parallel.dp_shard=2", f"train.parallel={kept}").train.parallel == kept
    assert "becomes" not in capsys.readouterr().err


def test_dp_replicate_alone_means_ddp():
    assert config("parallel.dp_replicate=2").train.parallel == "ddp"
    assert config("parallel.dp_replicate=2", "train.parallel=ddp").train.parallel == "ddp"


@pytest.mark.parametrize("overrides, line", [
    (("parallel.dp_replicate=2", "parallel.dp_shard=2", "train.parallel=zero2"),
     r"^parallel.dp_replicate=2 x parallel.dp_shard=2 \(hybrid sharding\) runs on FSDP2's 2-D mesh, not "
     r"lmforge's ZeRO: set train.parallel=fsdp$"),
    (("parallel.dp_replicate=2", "parallel.dp_shard=1", "train.parallel=zero1"),
     r"^parallel.dp_shard=1 with train.parallel=zero1 shards over one rank"),
    (("parallel.dp_shard=-1",), r"^parallel.dp_shard must be a whole number >= 1 \(0: inferred\), got -1$"),
])
def test_degrees_that_contradict_the_strategy_are_refused(overrides, line):
    with pytest.raises(LmforgeError, match=line):
        config(*overrides)


def test_the_degrees_of_a_launch_inferred_as_today():
    # unset: dp = world / (pp cp tp), sharded by a sharding strategy, replicated by ddp
    assert mesh_degrees(config("parallel.tp=2", "train.parallel=zero2"), 8) == Degrees(1, 1, 4, 1, 2)
    assert mesh_degrees(config("parallel.tp=2", "train.parallel=ddp"), 8) == Degrees(1, 4, 1, 1, 2)
    # the layout: tp 2 x dp_shard 2 on 4 ranks
    assert mesh_degrees(config("parallel.tp=2", "parallel.dp_shard=2"), 4) == Degrees(1, 1, 2, 1, 2)
    # one dp degree given: the other inferred (dp_shard 2 on 8 ranks: 8 data ranks, 4 replicate groups: HSDP)
    hybrid = mesh_degrees(config("parallel.dp_shard=2"), 8)
    assert hybrid == Degrees(1, 4, 2, 1, 1) and hybrid.hybrid
    both = mesh_degrees(config("parallel.dp_replicate=2", "parallel.dp_shard=2"), 4)
    assert both == Degrees(1, 2, 2, 1, 1) and both.hybrid and both.dp == 4


@pytest.mark.parametrize("overrides, world, line", [
    (("parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"), 4,
     r"^pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 2 = 8 ranks, but the world is 4: launch 8 processes "
     r"or change the degrees$"),
    (("parallel.tp=2", "parallel.dp_shard=3"), 8,
     r"^parallel.dp_shard=3 must divide the 4 data-parallel ranks \(world 8 / \(pp 1 x cp 1 x tp 2\)\)"),
    (("parallel.dp_replicate=2",), 4, r"^parallel.dp_replicate=2 must equal the 4 data-parallel ranks"),
    (("parallel.tp=2", "parallel.dp_shard=2"), 5,
     r"^the world of 5 ranks is not a multiple of pp 1 x cp 1 x tp 2 = 2"),
    (("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.cp=2"), 8,
     r"^parallel.dp_replicate=2 x parallel.dp_shard=2 \(hybrid sharding\) does not combine with parallel.cp=2 yet"),
])
def test_the_launch_check_refuses_degrees_that_do_not_fit_the_world(overrides, world, line):
    with pytest.raises(LmforgeError, match=line):
        launched(config(*overrides), world)


def test_the_launch_check_accepts_degrees_that_fit():
    assert launched(config("parallel.tp=2", "parallel.dp_shard=2"), 4).type == "cpu"
    assert launched(config("parallel.dp_replicate=2", "parallel.dp_shard=2"), 4).type == "cpu"
    assert launched(config("parallel.pp=2", "parallel.dp_replicate=2"), 4).type == "cpu"  # 2 stages x 2 replicas


def test_a_refusal_on_the_command_line_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--model", "tiny", "--nproc", "4", "train.parallel=fsdp", "parallel.tp=2",
                   "parallel.dp_replicate=2", "parallel.dp_shard=2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "= 8 ranks, but the world is 4" in err[0], err
    assert not out.exists()


def test_the_plan_of_hybrid_sharding_holds_one_shard_group_share():
    """HSDP over dp_replicate 2 x dp_shard 2 holds what FSDP over 2 ranks holds (1/dp_shard), and
    sends FSDP-over-2's traffic plus the all-reduce, over 2 replicas, of its gradient shard."""
    model = config().model
    hsdp = make_plan(config("train.parallel=fsdp", "parallel.dp_replicate=2"), Costing(dp=4, hardware="h100-sxm"))
    fsdp2 = make_plan(config("train.parallel=fsdp"), Costing(dp=2, hardware="h100-sxm"))
    one = make_plan(config(), Costing(hardware="h100-sxm"))
    for key in ("parameters", "gradients", "optimizer_states"):
        assert hsdp["memory"]["breakdown_bytes"][key] == fsdp2["memory"]["breakdown_bytes"][key]
        assert fsdp2["memory"]["breakdown_bytes"][key] * 2 >= one["memory"]["breakdown_bytes"][key]
    shard_group = step_communication(model, "fsdp", 2)
    shard_elements = sum(-(-n // 2) * 2 for n in unit_sizes(model).values()) // 2  # padded units, halved
    sent = hsdp["communication"]
    assert sent["replicate"]["ring_elements"] == 2 * shard_elements
    assert sent["sent_bytes"] == shard_group["sent_bytes"] + 2 * shard_elements * 4 * (2 - 1) / 2


def test_plan_flags(capsys):
    assert main(["plan", "--model", "tiny", "--dp-shard", "2", "--dp-replicate", "2", "--hardware", "h100-sxm"]) == 0
    assert "dp_replicate 2 x dp_shard 2 x tp 1 x pp 1 = 4" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny", "--dp", "4", "--dp-shard", "2", "--hardware", "h100-sxm"]) == 2
    assert capsys.readouterr().err.strip().endswith("give --dp-shard N --dp-replicate M (dp = N x M) or --dp")
    assert main(["plan", "--model", "tiny", "--dp-shard", "2", "--dp-replicate", "2", "--zero-stage", "2",
                 "--hardware", "h100-sxm"]) == 2
