"""The precision policies by name: what each stores and computes in, and what that costs in bytes.

One entry per policy carries everything the rest of lmforge asks of it: config/validate.py validates
`train.precision` against these names, precision/policy.py applies a policy to a model (the torch
side: it turns the dtype names here into torch dtypes), and accounting/ reads the bytes per
element (memory.py) and the dtype of the matmul peak (plan.py). Light on purpose: no torch, so
that parsing a config or `lmforge --help` does not load it.

    policy       parameters  grads  AdamW m, v  forward matmuls        loss scaling
    fp32         fp32        fp32   fp32        fp32                   no
    bf16-mixed   fp32        fp32   fp32        bf16 (autocast)        no
    fp16-mixed   fp32        fp32   fp32        fp16 (autocast)        dynamic (precision/policy.py)
    bf16-pure    bf16        bf16   bf16        bf16                   no
    fp8          fp32        fp32   fp32        fp8 linears, rest bf16 no (per-tensor fp8 scales)

precision/policy.py says why each is what it is (Micikevicius et al. 2018 and 2022).
"""

from dataclasses import dataclass

from lmforge.common.errors import lookup


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor a policy stores (accounting/memory.py)."""
    parameter: int  # the parameters the model holds
    gradient: int
    master: int  # a separate fp32 master copy of the weights (0: the parameters are the master)
    optimizer_state: int  # each optimizer state element (AdamW has two per parameter)
    compute: int  # matmul outputs and the attention tensors
    linear_input: int  # what a block's linear layer keeps of its input for the weight gradient
    weight_copy: int  # a cast of each block linear weight made in forward, kept for backward (0: none)
    head_weight_copy: int  # the same for the LM head's weight
    residual: int  # the residual stream: fp32 around autocast (the embedding output is fp32), else the parameters'
    fp8_scales: int = 0  # bytes of per-tensor scales each block linear keeps (fp8: input and weight)


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: str  # parameters, their gradients and the AdamW moments (a torch dtype's name)
    compute_dtype: str | None  # autocast dtype of the forward pass; None: no autocast
    matmul_dtype: str  # whose peak FLOP/s its matmuls run at (accounting/hardware.py's names)
    loss_scaling: bool  # dynamic loss scaling (fp16)
    fp8: bool  # the blocks' linear layers compute in fp8
    bytes: PrecisionBytes

    @property
    def autocast(self) -> bool:
        """Low precision by torch.autocast around fp32 parameters (and an fp32 residual stream)."""
        return self.compute_dtype is not None

    @property
    def lossy_updates(self) -> bool:
        """Parameters in 16 bits: small updates can round to nothing (worth counting)."""
        return self.param_dtype != "float32"


POLICIES: dict[str, Policy] = {policy.name: policy for policy in (
    Policy("fp32", "float32", None, "float32", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=4, linear_input=4, weight_copy=0, head_weight_copy=0,
                                residual=4)),
    # torch.autocast keeps fp32 parameters (they are the master weights, Micikevicius et al. 2018)
    # and casts each weight and each linear input to 16 bits per use; the casts live until backward.
    Policy("bf16-mixed", "float32", "bfloat16", "bfloat16", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                residual=4)),
    Policy("fp16-mixed", "float32", "float16", "float16", loss_scaling=True, fp8=False,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=2, weight_copy=2, head_weight_copy=2,
                                residual=4)),
    # Everything in bfloat16, optimizer states included: half the model-state bytes of fp32.
    Policy("bf16-pure", "bfloat16", None, "bfloat16", loss_scaling=False, fp8=False,
           bytes=PrecisionBytes(2, 2, 0, 2, compute=2, linear_input=2, weight_copy=0, head_weight_copy=0,
                                residual=2)),
    # bf16-mixed, but each block linear keeps its weight and its input as 1-byte e4m3 with two fp32
    # scales (Micikevicius et al. 2022); the LM head stays in bf16 (precision/policy.py says why).
    Policy("fp8", "float32", "bfloat16", "float8", loss_scaling=False, fp8=True,
           bytes=PrecisionBytes(4, 4, 0, 4, compute=2, linear_input=1, weight_copy=1, head_weight_copy=2,
                                residual=4, fp8_scales=8)),
)}
# Short names `lmforge plan --precision` also takes.
ALIASES = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}

# fp8's per-tensor scaling recipes (precision/fp8.py).
FP8_SCALINGS = {
    "current": "the scale comes from this tensor's own amax",
    "delayed": "the scale comes from the largest amax of the last steps (Transformer Engine's default)",
}


def get_policy(name: str) -> Policy:
    """The policy `name` stands for (aliases resolved); UnknownName if there is none."""
    return lookup({**POLICIES, **{alias: POLICIES[full] for alias, full in ALIASES.items()}}, name, "precision")
