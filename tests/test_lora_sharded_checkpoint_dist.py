"""LoRA checkpoints under the sharded engines: `lmforge finetune --lora-rank 4` under train.parallel=
zero3 and fsdp, on 2 ranks and on 4 (parallel.tp=2 x 2 data-parallel ranks), real processes on gloo.

ZeRO-3 frees the adapters' flat storage between steps and FSDP2 holds them as DTensor shards, so a
checkpoint that read the adapter parameters directly crashed (zero3: a segmentation fault reading
freed storage; fsdp: a DTensor where a tensor was expected). A checkpoint goes through the engine's
state by name (parallel/engine.py: whole tensors by name from every engine), saving and loading.

Checked for each cell:
  - a run resumed from its step-2 checkpoint to step 4 equals the uninterrupted 4-step run bit for
    bit (losses and adapters): the same operations in the same order from the same fp32 state and
    generators, so nothing may differ;
  - its adapters and its PEFT export (`lmforge export --format peft`) equal one process's with the
    global batch within 1e-5: the ranks' averaged gradients differ from one mean in the last bits
    (measured here: at most 3.3e-6 after 4 steps), while a missing slice, a wrong shard or an
    unaveraged gradient moves an adapter by about lr = 1e-3 per step.
"""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmforge.runs.checkpoint.find import find_checkpoint, list_checkpoints
from lmforge.runs.checkpoint.read import read_tensors
from test_distributed_train import env, losses
from test_finetune_dist import STEPS, TIMEOUT, base, common, finetune, settings  # noqa: F401 (base: a fixture)

pytestmark = pytest.mark.dist

ATOL = 1e-5  # against one process: see the module docstring
LORA = ["--lora-rank", "4"]
CELLS = {"zero3": (2, []), "fsdp": (2, []), "tp=2 x zero3": (4, ["parallel.tp=2"]), "tp=2 x fsdp": (4, ["parallel.tp=2"])}
# each engine once by default (~2 min on a loaded 2-core CPU); the other two cells under -m "dist and slow"
SLOW = {"fsdp", "tp=2 x zero3"}


def export_peft(cwd, run: str) -> dict[str, torch.Tensor]:
    """`lmforge export RUN --format peft` (one process, from the run's last checkpoint): its adapter."""
    result = subprocess.run([sys.executable, "-m", "lmforge", "export", run, "--format", "peft", "--out",
                             f"{run}-peft"], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-2000:]
    return load_file(str(cwd / f"{run}-peft" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def one_process(base, corpus_dir, tmp_path_factory):  # noqa: F811
    """The reference: one process, the global batch of 4, its checkpoint's adapters and PEFT export."""
    cwd = tmp_path_factory.mktemp("one")
    finetune(cwd, *common(base, corpus_dir, *LORA, *settings(4)), "--out", "one")
    return read_tensors(find_checkpoint(cwd / "one")), export_peft(cwd, "one")


@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CELLS])
def test_a_sharded_lora_run_resumes_bit_for_bit_and_equals_one_process(base, corpus_dir, tmp_path,  # noqa: F811
                                                                       one_process, cell):
    nproc, extra = CELLS[cell]
    strategy = cell.split(" x ")[-1]
    batch = 4 // (nproc // (2 if extra else 1))  # 4 rows over the data-parallel ranks
    finetune(tmp_path, *common(base, corpus_dir, *LORA, *settings(batch)), f"train.parallel={strategy}", *extra,
             "--out", "whole", nproc=nproc)
    # the same run stopped after its step-2 checkpoint: its folder as it was then, resumed to step 4
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_0000004")
    (tmp_path / "resumed" / "summary.json").unlink()
    assert [p.name for p in list_checkpoints(tmp_path / "resumed")] == ["step_0000002"]
    finetune(tmp_path, "--resume", "resumed", f"train.max_steps={STEPS}", "train.dist_timeout=30", nproc=nproc)

    whole, resumed = (read_tensors(find_checkpoint(tmp_path / run)) for run in ("whole", "resumed"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")
    assert whole.keys() == resumed.keys() and all(n.endswith((".lora_A", ".lora_B")) for n in whole)
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name

    reference, reference_peft = one_process
    assert resumed.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], rtol=0, atol=ATOL, msg=name)
    peft = export_peft(tmp_path, "resumed")
    assert peft.keys() == reference_peft.keys()
    for name in reference_peft:
        torch.testing.assert_close(peft[name], reference_peft[name], rtol=0, atol=ATOL, msg=name)
