"""The optimizer phase's fixed cost measured whole (measure.measure_optimizer_phase,
roofline.op_time's "phase" op): the fit's arithmetic, how a step charges it in place of its
operators' launches, and what the measurement runs. No timed assertion."""

import dataclasses

import pytest
import torch

from lmforge.accounting.roofline import Roof, op_time, predict
from lmforge.accounting.roofline.measure import MINIMAL, _optimizer_phase, line_through
from lmforge.accounting.roofline.ops import Op, optimizer_phase_op, step_ops
from lmforge.accounting.shapes import model_shapes
from lmforge.config import make_config
from lmforge.model.transformer import Transformer
from lmforge.train.roofline import one_process_engine


def _roof(**fields) -> Roof:
    flat = {d: [[1, 1, 1, 1e12]] for d in ("float32", "bfloat16")}
    flat2 = {d: [[1, 1, 1e12]] for d in ("float32", "bfloat16")}
    return Roof("synthetic", 1e11, flat, flat2, flat2, [[1, 1e11]], **fields)


def test_the_line_goes_through_both_points():
    """t = fixed + n x per_tensor through (11, 300 us) and (29, 480 us): 10 us a tensor, 190 us fixed."""
    line = line_through((11, 3.0e-4), (29, 4.8e-4))
    assert line["per_tensor_s"] == pytest.approx(1e-5, rel=1e-12)
    assert line["fixed_s"] == pytest.approx(1.9e-4, rel=1e-9)
    for n, t in ((11, 3.0e-4), (29, 4.8e-4)):
        assert line["fixed_s"] + n * line["per_tensor_s"] == pytest.approx(t, rel=1e-12)


def test_the_phase_pays_its_measured_line_in_place_of_its_operators_launches():
    """The phase op costs fixed + tensors x per_tensor; an op of the phase (launched=False) pays its
    bytes only. On a roof measured before the phase was (no optimizer_phase), the op costs nothing
    and the phase's operators keep their launches: the prediction is what it was."""
    phase = dataclasses.replace(optimizer_phase_op(make_config("tiny").model), calls=20)
    update = Op("adamw", "optimizer", "foreach", 0.0, 1e6, (), 10, "float32", "_foreach_mul_", launched=False)
    roof = _roof(optimizer_phase={"fixed_s": 5e-5, "per_tensor_s": 4e-6}, call_seconds=1e-6, foreach_call_seconds=2e-6)
    t = op_time(roof, phase)
    assert t["seconds"] == pytest.approx(5e-5 + 20 * 4e-6, rel=1e-12) and t["launch_s"] == t["seconds"]
    assert t["compute_s"] == t["memory_s"] == 0.0
    assert op_time(roof, update)["seconds"] == pytest.approx(1e6 / 1e11, rel=1e-12)  # bytes / the add's rate
    step = predict(roof, [phase, update], tokens_per_step=512)
    assert step["classes"]["optimizer"]["seconds"] == pytest.approx(1.3e-4 + 1e-5, rel=1e-12)
    older = dataclasses.replace(roof, optimizer_phase={})
    assert op_time(older, phase)["seconds"] == 0.0
    assert op_time(older, update)["seconds"] == pytest.approx(1e-5 + 10 * 2e-6, rel=1e-12)


@pytest.mark.parametrize("optimizer, charged", [("adamw", True), ("sgd", False)])
def test_the_step_charges_it_once_over_the_models_parameter_tensors(optimizer, charged):
    """One op per step over every parameter tensor, a tied one once (tiny: 20), for AdamW, the
    optimizer it is measured with, whose phase's operators then pay no launch of their own; another
    optimizer's operators keep theirs."""
    cfg = make_config("tiny", overrides=[f"optim.name={optimizer}"])
    ops = step_ops(one_process_engine, cfg, 1, "none")
    phases = [op for op in ops if op.kind == "phase"]
    tensors = len(list(Transformer(cfg.model).parameters()))
    assert tensors == len(model_shapes(cfg.model).parameter_shapes) == 20
    assert [(op.cls, op.calls) for op in phases] == ([("optimizer", tensors)] if charged else [])
    assert {op.launched for op in ops if op.cls == "optimizer" and op.kind != "phase"} == {not charged}
    assert all(op.launched for op in ops if op.cls != "optimizer")


def test_the_measurement_runs_minimals_phase_on_its_parameter_tensors():
    """MINIMAL at 1 and 3 layers has 11 and 29 parameter tensors (the fit's two points)."""
    device = torch.device("cpu")
    for layers, tensors in ((1, 11), (3, 29)):
        n, seconds = _optimizer_phase(layers, device)
        model = Transformer(dataclasses.replace(MINIMAL, n_layers=layers))
        assert n == tensors == len(list(model.parameters()))
        assert seconds > 0
