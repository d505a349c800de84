"""What lmforge train lets a pipeline of tensor-parallel stages run (parallel/world.py, one process:
no process group is needed to check), and the plan's per-stage figures those runs measure
(tests/test_tp_pipeline_dist.py compares them with each rank; these are its numbers, by hand)."""

import pytest
import torch

from lmforge.accounting.plan.make import Costing, make_plan
from lmforge.common.errors import LmforgeError
from lmforge.config import make_config
from lmforge.parallel.world import check_launch

PP_TP = ["parallel.pp=2", "train.micro_batches=2", "parallel.tp=2"]
SP = ["parallel.sequence_parallel=true", "train.sample_tokens=0"]  # no end-of-run sample under sequence parallelism
LAYERS4 = ["model.n_layers=4", "train.pipeline_virtual_stages=2", "train.schedule=interleaved-1f1b"]


@pytest.mark.parametrize("extra", [[], LAYERS4, ["train.pipeline_engine=torch"], SP])
def test_interleaved_torch_engine_and_sequence_parallel_tp_stages_launch(extra):
    cfg = make_config("tiny", overrides=[*PP_TP, *extra])
    assert check_launch(cfg, (0, 4, 0), cuda_devices=0) == torch.device("cpu")


def test_the_torch_engine_with_sequence_parallel_tp_stages_is_refused_in_one_line():
    cfg = make_config("tiny", overrides=[*PP_TP, "train.pipeline_engine=torch", *SP])
    with pytest.raises(LmforgeError, match="with parallel.tp=2 does not combine with parallel.sequence_parallel: "
                                           "train.pipeline_engine=torch's stages with sequence shards are untested"):
        check_launch(cfg, (0, 4, 0), cuda_devices=0)


def stages(*extra: str) -> list[dict]:
    cfg = make_config("tiny", overrides=[*PP_TP, "train.batch_size=4", "train.seq_len=64", *extra])
    return make_plan(cfg, Costing(hardware="h100-sxm"))["pipeline"]["stages_detail"]


def test_a_tp_stage_holds_its_matrices_slices_and_its_norm_gains_whole():
    # tiny: d 64, ffn 192, vocab 512, 2 KV heads of 16; stage 0 = the embedding + block 0, stage 1 =
    # block 1 + the final norm + the tied head's copy. A block's slices on one of 2 ranks: q, o
    # 64 x 32 each, k, v 16 x 64 each, gate, up, down 96 x 64 each; its two gains 64 each, whole
    block = 2 * 64 * 32 + 2 * 16 * 64 + 3 * 96 * 64 + 2 * 64
    embedding = 256 * 64  # the vocabulary's half
    held = [s["breakdown_bytes"]["parameters"] for s in stages()]
    assert held == [4 * (embedding + block), 4 * (block + 64 + embedding)] == [164_352, 164_608]


@pytest.mark.parametrize("sp", [False, True])
def test_each_tensor_rank_sends_the_whole_stream_or_with_sequence_parallelism_its_shard(sp):
    sent = [s["sent_bytes_per_step"] for s in stages(f"parallel.sequence_parallel={str(sp).lower()}")]
    stream = 2 * 4 * 64 * 64 * 4 // (2 if sp else 1)  # m micro-batches of b x s x d, fp32
    assert [s["activations"] for s in sent] == [stream, 0]
    assert [s["activation_gradients"] for s in sent] == [0, stream]
