"""Run by tests/test_roofline_dist.py under torchrun (not a test module itself): all-reduce,
reduce-scatter and all-gather measured on the launched gloo group (bench/collectives.py, every
rank), then rank 0 prints, as JSON, the roofline's step of tiny under the strategy in argv[1] on a
synthetic roof with that network: the step's seconds and its communication class's."""

import dataclasses
import json
import sys

import torch.distributed as dist

from lmforge.accounting.roofline.ops import predict_step
from lmforge.config import make_config
from lmforge.train.roofline import one_process_engine

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/bench")
from collectives import measure_collective  # noqa: E402
from test_roofline_comm import _roof  # noqa: E402

dist.init_process_group("gloo")
collective = measure_collective()
if dist.get_rank() == 0:
    strategy = sys.argv[1]
    run = make_config("tiny", overrides=[f"train.parallel={strategy}"])
    roof = dataclasses.replace(_roof(), collective=collective)
    predicted = predict_step(one_process_engine, run, 2, roof, strategy)
    print(json.dumps({"step": predicted["seconds_per_step"],
                      "communication": predicted["classes"]["communication"]["seconds"]}))
dist.destroy_process_group()
