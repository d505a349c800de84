"""A rank stuck in a collective when SIGTERM comes (tests/test_faults_dist.py): under torchrun, rank 0
waits in dist.recv for rank 1, which sleeps and never sends (a hung rank); rank 0 writes
`waiting` in the working directory first. The group's timeout (300 s) is far past the test's."""

import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.parallel.world import World, env_world
from lmforge.train.signals import StopRequests

rank, world_size, local_rank = env_world()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
world = World(rank=rank, world_size=world_size, local_rank=local_rank, device=torch.device("cpu"))
dist.barrier()
if rank == 0:
    with StopRequests(stuck=world.report_stuck):
        Path("waiting").write_text("1")
        dist.recv(torch.zeros(1), src=1)  # never answered: the main thread stays in C++
else:
    time.sleep(300)
