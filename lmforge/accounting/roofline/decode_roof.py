"""The roof a decode step runs on (accounting/roofline/__init__.py's Roof, adjusted): a decode step
multiplies `batch` rows (1 to a few) by each weight matrix, far below the training grid's smallest
M of 64, and runs under torch.no_grad through the model's modules, one small kernel after another.

Two more things are measured (about two seconds, cached as the roof is: accounting/hardware.py's
cache, `--remeasure` replaces it):
- matmul FLOP/s at GEMV-like shapes: M in GEMV_ROWS by every (N, K) of the training grid's
  (measure.MATMUL_DIMS), so that with the training grid they form one regular grid in M
  (interpolated in log2 M as any other dimension: roofline.interpolate), each call reading its
  weights from memory (measure.measure_matmuls with cold_megabytes);
- the fixed cost of one operator of a decode step: the step of a model so small that none of its
  operators does measurable work (one layer, width 16, vocabulary 32, 16 cached positions), timed
  and divided by the aten operators it dispatches as roofline/trace.py counts them. This is what a
  call costs in this code's decode path: the module calls, the Python between operators and the
  composite operators above the recorded ones (F.linear above t, mm, view) are paid per operator,
  which a chain of adds (the training roof's launch cost) does not pay. Views are counted alike.

`decode_roof(roof, measured)` is `roof` with the grid extended downward and that launch cost;
everything else (bandwidth, elementwise rates) is the same machine's.
"""

import dataclasses

import torch

from lmforge.accounting.hardware import _measured, device_name
from lmforge.accounting.roofline import Roof
from lmforge.accounting.roofline.measure import MINIMAL, _best_rate, measure_matmuls
from lmforge.accounting.roofline.trace import dispatched_calls
from lmforge.model.transformer import Transformer

GEMV_ROWS = (1, 8)  # rows of a decode step's matmuls: batch 1 and batch 8
MINIMAL_CONTEXT = 16


@torch.no_grad()
def measure_decode_call(decoder, device: torch.device) -> float:
    """Seconds per dispatched operator of MINIMAL's decode step (model forward and greedy choice:
    `decoder`, as decode.record_decode takes it)."""
    step = decoder(Transformer(MINIMAL).to(device).eval(), 1, MINIMAL_CONTEXT)
    return 1 / _best_rate(step, dispatched_calls(step), device, runs=3, seconds=0.05)


def measure_decode(decoder, device: torch.device) -> dict:
    """The decode roof's measurements as a JSON-ready dict, the global RNG left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return {"gemv": measure_matmuls(device, GEMV_ROWS, cold_megabytes=128),
                "call_seconds": measure_decode_call(decoder, device)}


def this_decode_measurements(decoder, device: torch.device, remeasure: bool = False, store: bool = True) -> dict:
    """measure_decode's result for this machine, from the cache unless `remeasure`."""
    key = f"roofline decode v2|{device_name(device)}|torch {torch.__version__}"
    return _measured(key, "decode", lambda: measure_decode(decoder, device), remeasure, store)


def decode_roof(roof: Roof, measured: dict | None) -> Roof:
    """`roof` for a decode step: the GEMV rows added to each dtype's matmul grid (where their N and
    K are the grid's), the decode path's cost per operator for calls and views alike; `measured`
    None (a datasheet roof): `roof` itself."""
    if not measured:
        return roof
    matmul = {}
    for dtype, rows in roof.matmul.items():
        extra = measured["gemv"].get(dtype, [])
        same_axes = {tuple(r[1:3]) for r in extra} == {tuple(r[1:3]) for r in rows}
        smallest = min(r[0] for r in rows)
        matmul[dtype] = rows + [r for r in extra if r[0] < smallest] if same_axes else rows
    return dataclasses.replace(roof, matmul=matmul, call_seconds=measured["call_seconds"],
                               view_call_seconds=measured["call_seconds"], name=f"{roof.name} (decode)")
