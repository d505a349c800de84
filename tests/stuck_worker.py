"""A rank waiting in a collective when SIGTERM comes (tests/test_faults_dist.py), under torchrun.

`hung` (the default): rank 0 waits in dist.recv for rank 1, which sleeps and never sends (a hung
rank); rank 0 writes `waiting` in the working directory first.
`slow`: every rank in StopRequests as the trainer's; rank 0 waits in dist.recv while rank 1 takes a
slow step (STUCK_SECONDS + 3 s, in Python, so it takes its SIGTERM at once), then sends; rank 0
then saves its checkpoint (ROLL_CALL_SECONDS + 2 s, past any roll call its watch took); each rank
writes `stopped<rank>` with the signal it recorded. A plain stop: rank 0 must not report rank 1.
The group's timeout (300 s) is far past the test's."""

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.parallel.faults import ROLL_CALL_SECONDS
from lmforge.parallel.world import World, env_world
from lmforge.train.signals import STUCK_SECONDS, StopRequests


def busy(seconds: float) -> None:
    """Python work (a step, a checkpoint write): the SIGTERM handler runs between its bytecodes."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        time.sleep(0.05)


mode = sys.argv[1] if len(sys.argv) > 1 else "hung"
rank, world_size, local_rank = env_world()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
world = World(rank=rank, world_size=world_size, local_rank=local_rank, device=torch.device("cpu"))
dist.barrier()
if mode == "hung":
    if rank == 0:
        with StopRequests(stuck=world.report_stuck):
            Path("waiting").write_text("1")
            dist.recv(torch.zeros(1), src=1)  # never answered: the main thread stays in C++
    else:
        time.sleep(300)
else:
    with StopRequests(stuck=world.report_stuck, alive=world.answer_roll_call) as stop:
        Path(f"waiting{rank}").write_text("1")
        if rank == 0:
            dist.recv(torch.zeros(1), src=1)  # in C++ while rank 1's step runs on
            busy(ROLL_CALL_SECONDS + 2.0)  # the checkpoint
        else:
            busy(STUCK_SECONDS + 3.0)  # the slow step
            dist.send(torch.zeros(1), dst=0)
        Path(f"stopped{rank}").write_text(str(stop.received))
    dist.barrier()
    dist.destroy_process_group()
