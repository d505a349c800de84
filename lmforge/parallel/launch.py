"""The one launch check: whether the config can run on the processes torchrun started (what
combines, asked of config/rules.py with the world size; the device each rank takes), refused in
one line before any process group exists (parallel/world.py's `init_world` calls `check_launch`
once), and the device a name stands for."""

import torch

from lmforge.common.errors import LmforgeError
from lmforge.config.rules import check_composition


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
    with the world torchrun started; the device each rank takes is checked here."""
    check_composition(cfg, None if env is None else env[1])
    if env is None:
        return resolve_device(cfg.train.device)
    return _rank_device(cfg.train.device, env[2], cuda_devices)


def _rank_device(name: str, local_rank: int, cuda_devices: int) -> torch.device:
    """The device of train.device=`name` for the rank LOCAL_RANK=`local_rank` under torchrun."""
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
