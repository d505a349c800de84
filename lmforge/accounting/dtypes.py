"""The floating-point formats a run can store and compute in, described from `torch.finfo`.

A binary float with e exponent bits and m mantissa (fraction) bits has machine epsilon 2^-m, so
m = -log2(eps) and e = bits - 1 - m (one sign bit). The fp8 formats are those of Micikevicius et
al. 2022, "FP8 Formats for Deep Learning", table 1: E4M3 (more precision, max 448, no infinities:
the "fn" in float8_e4m3fn) for weights and activations, E5M2 (more range, max 57344) for
gradients. `bytes` is what every memory figure in accounting/memory.py multiplies by.
"""

import math
from dataclasses import dataclass

import torch

# name used in configs and tables -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class DtypeInfo:
    name: str
    bits: int
    bytes: int
    exponent_bits: int
    mantissa_bits: int
    max: float  # largest finite value
    smallest_normal: float
    eps: float  # gap between 1.0 and the next representable number


def dtype_info(dtype: str | torch.dtype) -> DtypeInfo:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    finfo = torch.finfo(dtype)
    mantissa = round(-math.log2(finfo.eps))
    return DtypeInfo(name=str(dtype).removeprefix("torch."), bits=finfo.bits, bytes=finfo.bits // 8,
                     exponent_bits=finfo.bits - 1 - mantissa, mantissa_bits=mantissa, max=finfo.max,
                     smallest_normal=finfo.smallest_normal, eps=finfo.eps)


def dtype_table() -> list[DtypeInfo]:
    return [dtype_info(name) for name in DTYPES]
