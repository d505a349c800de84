"""Numeric precision of training, applied to a built model: the policy applied (policy.py: parameter
dtype, autocast, fp8 linears, the fp32 attention core, fp16's dynamic loss scaling), fp8 (fp8.py).
The policies by name, with their bytes and matmul dtype, are torch-free in lmforge/modes/__init__.py."""
