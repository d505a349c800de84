"""Numeric precision of training: policies (policy.py), dynamic loss scaling (loss_scaler.py), fp8 (fp8.py)."""

from lmforge.precision.fp8 import Fp8Linear, dequantize, quantize, scale_for
from lmforge.precision.loss_scaler import LossScaler
from lmforge.precision.policy import POLICIES, Policy, autocast, device_notes, get_policy, prepare_model

__all__ = ["POLICIES", "Fp8Linear", "LossScaler", "Policy", "autocast", "dequantize", "device_notes",
           "get_policy", "prepare_model", "quantize", "scale_for"]
