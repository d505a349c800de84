"""Step time of a context-parallel run (parallel.cp=2) eager and with train.compile=true, in one
launch so that the two share the machine's load (compare the ratio, not the times):

    python -m torch.distributed.run --nproc_per_node=2 bench/cp_compile.py [SEQ] [STEPS]

torch.compile graph-breaks at the ring's point-to-point ops (docs/context-parallel.md), so each
block runs as compiled graphs around an eager ring. Rank 0 prints the median step time of each
after 2 warm-up steps (the compile happens there) and their ratio.
"""

import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lmforge.config import make_config
from lmforge.modes import get_policy
from lmforge.precision.policy import LossScaler
from lmforge.train.loop import train_step
from lmforge.train.setup import build_engine

WARMUP = 2


def step_times(compiled: bool, seq: int, steps: int) -> list[float]:
    cfg = make_config("tiny", overrides=["parallel.cp=2", "train.parallel=ddp", "train.sample_tokens=0",
                                         f"model.max_seq_len={seq}", f"train.seq_len={seq}",
                                         f"train.compile={str(compiled).lower()}"])
    torch.manual_seed(cfg.train.seed)
    engine, policy = build_engine(cfg, get_policy("fp32")), get_policy("fp32")
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(WARMUP + steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, seq + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        train_step(engine, lambda: (tokens[:, :-1], tokens[:, 1:]), 1, cfg.optim.lr, cfg.optim.grad_clip,
                   LossScaler(enabled=False), policy, torch.device("cpu"))
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def main(seq: int, steps: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    eager, compiled = step_times(False, seq, steps), step_times(True, seq, steps)
    if dist.get_rank() == 0:
        e, c = statistics.median(eager), statistics.median(compiled)
        print(f"cp=2 tiny seq {seq}, {steps} steps: eager {e * 1e3:.0f} ms/step, compiled {c * 1e3:.0f} ms/step, "
              f"compiled/eager {c / e:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
