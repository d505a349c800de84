"""The names of the attention backends (implemented in attention.py).

Kept apart from attention.py, which loads torch, so that config validation and `lmforge --help`
can name them without importing torch (seconds on a busy machine).
"""

BACKENDS = ("naive", "sdpa", "flash_torch", "flash_triton", "auto")
FLASH_BACKENDS = ("flash_torch", "flash_triton")
