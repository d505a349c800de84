"""The activation recomputation modes by name (Chen et al. 2016; Korthikanti et al. 2022), and
what each reruns in backward.

wrap/recompute.py applies a mode to a model (the torch side); config/validate.py validates
`train.recompute` against these names; accounting/ counts what each keeps (memory.py) and the
FLOPs it adds (shapes.py). A module without torch, so that config/ and accounting/ can
read it without importing the training code.
"""

from dataclasses import dataclass

from lmforge.common.errors import lookup


@dataclass(frozen=True)
class RecomputeMode:
    name: str
    blocks: bool  # each block keeps only its input; backward reruns the block's forward first
    attention_cores: bool  # each attention core (q, k, v -> softmax(QK^T)V) keeps only q, k, v and reruns
    description: str


RECOMPUTE_MODES: dict[str, RecomputeMode] = {mode.name: mode for mode in (
    RecomputeMode("none", blocks=False, attention_cores=False, description="keep every activation"),
    # the attention core holds the s x s terms that dominate memory at long sequence length, for a
    # small share of the FLOPs (Korthikanti et al. 2022, section 4.2)
    RecomputeMode("selective", blocks=False, attention_cores=True, description="rerun each attention core"),
    RecomputeMode("full", blocks=True, attention_cores=False, description="rerun each block from its input"),
)}


def get_recompute(name: str) -> RecomputeMode:
    return lookup(RECOMPUTE_MODES, name, "recompute mode")
