"""Attention kernels: FlashAttention-2 (Dao 2023) in PyTorch (flash_torch) and Triton (flash_triton).

lmforge.model.attention selects them as the `flash_torch` and `flash_triton` backends.
"""
