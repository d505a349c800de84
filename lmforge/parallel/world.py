"""Who this process is in a torch.distributed run, and the few collectives the training loop needs.

torchrun starts one process per device and tells each its place through the environment:

    RANK         0 .. WORLD_SIZE-1, unique across all nodes (rank 0 prints, logs and writes reports)
    WORLD_SIZE   processes in the run (nodes x processes per node)
    LOCAL_RANK   0 .. processes on this node - 1: which device of this node the process takes
    MASTER_ADDR, MASTER_PORT   where the rendezvous store is (torch.distributed reads them itself)

`init_world(cfg)` reads them and joins the process group: gloo on CPU, nccl on CUDA (device
cuda:LOCAL_RANK), with train.dist_timeout as the collective timeout, so that a rank that died or
hangs makes the others stop instead of waiting forever. Without torchrun's environment it returns
a one-process `World` and initialises nothing: today's single-process training, unchanged.
What a rank does about a peer or a launcher gone (`World.failure`, `watch_launcher`) is
parallel/faults.py's.
Every launch that cannot work is refused here (`check_launch`, the one check of a launch: what
combines, asked of config/rules.py with the world size, and the device each rank takes), before any
process group exists or any data is read or folder written; `resolve_device` is the device a name
stands for.
"""

import atexit
import contextlib
import datetime
import itertools
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmforge.common.errors import LmforgeError
from lmforge.parallel.faults import Faults, ReportedOnRank0, cause, watch_launcher
from lmforge.config.rules import check_composition

# A rank waiting for rank 0 in `World.main_first` polls the store this often, says so once rank 0
# has taken this long, and again at this interval.
WAIT_POLL_SECONDS = 0.2
WAIT_FIRST_NOTE_SECONDS = 2
WAIT_NOTE_SECONDS = 30
# Every rank calls main_first in the same order: the n-th call's store key is the same on all.
_MAIN_FIRST_CALLS = itertools.count()


@dataclass(frozen=True)
class World(Faults):
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    launcher_pid: int | None = None  # torchrun's agent, which started this rank (None: not watched)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is up (collectives needed), even of one process."""
        return dist.is_available() and dist.is_initialized()

    def setup_faults(self):
        """Around a run's setup, a rank lost is said in the same one line as during training
        (parallel/faults.py's `watching_setup`); one process has no rank to lose."""
        return self.watching_setup() if self.world_size > 1 else contextlib.nullcontext()

    # -- collectives; each is a no-op in one process -------------------------------------------

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def from_main(self, make):
        """Run `make()` on rank 0 alone and hand its result (or its LmforgeError) to every rank:
        what rank 0 decides about the run folder, every rank acts on."""
        if not self.distributed:
            return make()
        box = [None]
        if self.is_main:
            try:
                box[0] = ("ok", make())
            except LmforgeError as err:
                box[0] = ("error", str(err))
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise ReportedOnRank0(value)
        return value

    def measured_on_main(self, make, doing: str):
        """from_main for a measurement rank 0 may have to take (or retake: the machine cache redoes
        one taken while the machine was busier), which can outlast train.dist_timeout: the others
        wait through the store, as in main_first, then every rank gets rank 0's result."""
        result = self.main_first(lambda: make() if self.is_main else None, doing)
        return self.from_main(lambda: result)

    def main_first(self, make, doing: str = ""):
        """Rank 0 runs `make()` first (it may write: prepare the data, lock the run folder); once it
        has succeeded the other ranks run it (and find what rank 0 wrote). An error on rank 0 stops
        every rank. The others wait through the rendezvous store, not a collective: rank 0 may take
        longer than train.dist_timeout (preparing a large corpus). `doing` (e.g. "prepare data/x")
        is what the first waiting process of each node says it waits for."""
        if not self.distributed:
            return make()
        key = f"lmforge/main_first/{next(_MAIN_FIRST_CALLS)}"
        store = dist.distributed_c10d._get_default_store()
        if not self.is_main:
            self._wait_for_main(store, key, doing)
            return make()
        try:
            result = make()
        except BaseException as err:
            store.set(key, "error\n" + (str(err).strip() or type(err).__name__))  # the others stop too
            raise
        store.set(key, "ok\n")
        return result

    def _wait_for_main(self, store, key: str, doing: str) -> None:
        """Poll `key` until rank 0 sets it (no timeout: rank 0's work may take long). If rank 0 dies,
        torchrun's agent stops this process, or the store's host is gone and `check` raises."""
        says = doing and (self.rank == 1 or self.local_rank == 0)  # once per node
        started = time.monotonic()
        next_note = WAIT_FIRST_NOTE_SECONDS
        try:
            while not store.check([key]):
                waited = time.monotonic() - started
                if says and waited >= next_note:  # a quick rank 0 makes no noise
                    more = "still " if next_note > WAIT_FIRST_NOTE_SECONDS else ""
                    print(f"rank {self.rank}: {more}waiting for rank 0 to {doing} ({waited:.0f}s)",
                          file=sys.stderr, flush=True)
                    next_note += WAIT_NOTE_SECONDS
                time.sleep(WAIT_POLL_SECONDS)
            kind, message = store.get(key).decode().split("\n", 1)
        except dist.DistError as err:  # the store's host (rank 0's node) is gone
            raise LmforgeError(f"rank {self.rank} lost the rendezvous store while waiting for rank 0 "
                               f"({cause(err)}): rank 0 or its node stopped; run the launch again") from None
        if kind == "error":
            raise ReportedOnRank0(message)

    def first_error(self, error: BaseException | None) -> BaseException | None:
        """Every rank passes its own error (or None) and gets back the same answer: None, or the
        lowest failing rank's error (the exception itself on that rank, an LmforgeError naming the
        rank elsewhere), so that all ranks take the same branch after a step that may fail."""
        if not self.distributed:
            return error
        errors = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if not failed:
            return None
        rank, message = failed[0]
        return error if rank == self.rank else LmforgeError(f"rank {rank}: {message}")

    def raised(self, error: BaseException) -> BaseException:
        """`error` as this rank raises it: as is on rank 0, which prints it; quiet elsewhere."""
        return error if self.is_main else ReportedOnRank0(str(error))

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank has an error (see `first_error`)."""
        error = self.first_error(error)
        if error is not None:
            raise self.raised(error)

    def mean(self, value: float) -> float:
        """The mean of `value` over the ranks."""
        if not self.distributed:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total.item() / self.world_size

    def close(self) -> None:
        leave_group()


def env_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        values = tuple(int(os.environ.get(name, "0")) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise LmforgeError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them): "
                           "launch with torchrun or lmforge train --nproc N") from None
    rank, world_size, local_rank = values
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise LmforgeError(f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank} do not fit together: "
                           f"launch with torchrun or lmforge train --nproc N")
    return values


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """The torch device for `name` (auto, cpu, cuda, cuda:N), checked; `setting` names the option
    that gave it, for the message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LmforgeError(f"{setting}={name} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LmforgeError(f"{setting}={name}: lmforge runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmforgeError(f"{setting}={name} but no CUDA device is available: use cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LmforgeError(f"{setting}={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def check_launch(cfg, env: tuple[int, int, int] | None, cuda_devices: int) -> torch.device:
    """The device this rank trains on, once the launch fits the config; LmforgeError otherwise.
    The one check of a launch: `init_world` runs it before any process group exists. What combines
    with what (strategy, degrees, pipeline, tp, cp, optimizer ...) is config/rules.py's table, asked
    with the world torchrun started; the device each rank takes is checked here: under torchrun,
    cuda:LOCAL_RANK."""
    check_composition(cfg, None if env is None else env[1])
    name = cfg.train.device
    if env is None:
        return resolve_device(name)
    local_rank = env[2]
    if name == "auto":
        name = "cuda" if cuda_devices else "cpu"
    if not name.startswith("cuda"):
        return resolve_device(name)
    if name != "cuda":
        raise LmforgeError(f"train.device={name} under torchrun: each rank takes its own GPU "
                           f"(cuda:LOCAL_RANK); use train.device=cuda or auto")
    if cuda_devices == 0:
        raise LmforgeError("train.device=cuda under torchrun but no CUDA device is available: "
                           "use train.device=cpu (gloo)")
    if local_rank >= cuda_devices:
        raise LmforgeError(f"LOCAL_RANK {local_rank} but this node has {cuda_devices} CUDA device(s): start at "
                           f"most {cuda_devices} processes per node (--nproc_per_node={cuda_devices})")
    return torch.device("cuda", local_rank)


def init_world(cfg) -> World:
    """This process's place in the run, with the process group joined (see the module docstring)."""
    env = env_world()
    device = check_launch(cfg, env, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if env is None:
        return World(device=device)
    rank, world_size, local_rank = env
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.train.dist_timeout),
                                device_id=device if device.type == "cuda" else None)
        # leave the group before the interpreter tears down (every exit: done, stopped, refused),
        # not in C++'s static destructors with gloo's threads still running
        atexit.register(leave_group)
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                 launcher_pid=watch_launcher())


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
