import os
import sysconfig
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and peft imports it: set here,
# before any test module loads, so the kernels run in Triton's interpreter on a machine without CUDA
# whatever order the test files are collected in (a GPU runs them compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmforge.config import make_config  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Measured matmul peaks go to a per-session cache, not the user's home, measured once here as
    `lmforge train` measures them (a Trainer built directly reads the cache but never writes it)."""
    import torch

    from lmforge.accounting.hardware import this_device

    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    for dtype in ("float32", "bfloat16", "float16"):
        this_device(dtype, torch.device("cpu"))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 600 KB of real Python: the first modules of this interpreter's standard library."""
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"), 600_000)


def stdlib_corpus(folder: Path, characters: int, recursive: bool = False) -> Path:
    """`folder` filled with this interpreter's standard-library modules (its packages' too with
    `recursive`, flattened to one folder) until about `characters` characters of real Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py") if recursive else root.glob("*.py")):
        if "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace" if recursive else "strict")
        (folder / "_".join(path.relative_to(root).parts)).write_text(text)
        total += len(text)
        if total > characters:
            break
    return folder


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prepared") / "tiny-bpe512"


def tiny_overrides(corpus_dir: Path, data_dir: Path, **train) -> list[str]:
    settings = {"max_steps": 8, "batch_size": 4, "eval_interval": 4, "eval_batches": 2,
                "checkpoint_interval": 4, "log_interval": 2, "sample_tokens": 0, **train}
    return [f"data.source={corpus_dir}", f"data.dir={data_dir}", "optim.warmup_steps=2",
            *(f"train.{k}={v}" for k, v in settings.items())]


@pytest.fixture
def tiny_config(corpus_dir, data_dir):
    def build(*extra: str, **train):
        return make_config("tiny", overrides=[*tiny_overrides(corpus_dir, data_dir, **train), *extra])

    return build
