"""What pipelines combine with (issue 26), checked before launch: LoRA and ZeRO-1 over each stage's
replicas run (tests/test_pipeline_compose_dist.py trains them); ZeRO-2, ZeRO-3 and FSDP are refused
in one line that says why and what to use, by the launch check and by the plan alike."""

import re

import pytest
import torch

from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.cli import main
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.config.rules import PIPELINE_REFUSED
from lmforge.parallel.world import check_launch
from lmforge.parallel.parallelize import DATA_PARALLEL_ENGINES, STAGE_REPLICA_ENGINES


def launch(world_size: int, *overrides: str) -> torch.device:
    return check_launch(make_config("tiny", overrides=["parallel.pp=2", *overrides]),
                        (0, world_size, 0), cuda_devices=0)


@pytest.mark.parametrize("world_size,overrides", [
    (2, ["finetune.lora_rank=4"]),
    (4, ["train.parallel=zero1"]),
    (4, ["train.parallel=zero1", "finetune.lora_rank=4"]),
    (4, ["train.parallel=ddp", "finetune.lora_rank=4"]),
    (2, ["train.parallel=zero1"]),  # one replica per stage: ZeRO-1 over one rank, allowed
])
def test_pipelines_launch_with_lora_and_zero1(world_size, overrides):
    assert launch(world_size, *overrides) == torch.device("cpu")


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero2_zero3_and_fsdp_with_a_pipeline_are_refused_with_why_and_what_instead(strategy, world_size):
    with pytest.raises(LmforgeError) as raised:
        launch(world_size, f"train.parallel={strategy}")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"train.parallel={strategy} does not combine with parallel.pp=2: ")
    assert "m times a step" in message  # why: one backward per micro-batch
    assert message.endswith("use train.parallel=zero1 (shards each stage's optimizer states) or ddp")


def test_every_strategy_is_either_a_stage_replicas_engine_or_refused_on_pipelines():
    assert set(STAGE_REPLICA_ENGINES) | set(PIPELINE_REFUSED) == set(DATA_PARALLEL_ENGINES) | {"none"}
    assert not set(STAGE_REPLICA_ENGINES) & set(PIPELINE_REFUSED)


def test_replicas_without_a_strategy_are_refused():
    with pytest.raises(LmforgeError, match=re.escape("4 ranks = 2 stages x 2 replicas: choose how each stage's "
                                                     "replicas share its gradients: train.parallel=ddp or zero1")):
        launch(4)


def test_the_plan_shards_each_stages_optimizer_states_over_its_replicas_with_zero1():
    common = ["parallel.pp=2", "train.micro_batches=4", "train.precision=bf16-mixed"]
    ddp, zero1 = (make_plan(make_config("small", overrides=[*common, f"train.parallel={strategy}"]),
                            Costing(dp=4, hardware="h100-sxm"))["pipeline"]["stages_detail"]
                  for strategy in ("ddp", "zero1"))
    for d, z in zip(ddp, zero1):
        assert z["breakdown_bytes"]["optimizer_states"] == d["breakdown_bytes"]["optimizer_states"] / 4
        # the paper's layout: fp32 masters sharded with the moments, 16-bit working weights and gradients
        assert z["breakdown_bytes"]["master_weights"] == 4 * z["parameter_count"] / 4
        assert z["breakdown_bytes"]["parameters"] == d["breakdown_bytes"]["parameters"] / 2
        # reduce-scatter + all-gather of 16-bit elements: as many as DDP's all-reduce, half the bytes
        assert z["sent_bytes_per_step"]["data_parallel"] == d["sent_bytes_per_step"]["data_parallel"] / 2


@pytest.mark.parametrize("stage", [2, 3])
def test_the_plan_refuses_zero2_and_zero3_with_a_pipeline_in_one_line(stage, capsys):
    assert main(["plan", "--hardware", "h100-sxm", "--pp", "2", "--zero-stage", str(stage)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmforge: error: train.parallel=zero{stage} does not combine with "
                          f"parallel.pp=2: ZeRO-{stage} would") and err.count("\n") == 1
    assert "use train.parallel=zero1 (shards each stage's optimizer states) or ddp" in err
