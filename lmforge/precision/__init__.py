"""Numeric precision of training: the policies by name (policies.py, no torch), applying them to a
model (policy.py), dynamic loss scaling (loss_scaler.py), fp8 (fp8.py).

The names below are imported on first use (PEP 562), not with the package: config.py and
accounting/ read policies.py without loading torch through this file.
"""

import importlib

_HOMES = {"POLICIES": "policies", "Policy": "policies", "get_policy": "policies",
          "Fp8Linear": "fp8", "dequantize": "fp8", "quantize": "fp8", "scale_for": "fp8",
          "LossScaler": "loss_scaler",
          "autocast": "policy", "device_notes": "policy", "prepare_model": "policy"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
