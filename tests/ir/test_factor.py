"""Factors a sum does not vary with are taken out of it, exactly where that is safe."""

from __future__ import annotations

import numpy as np

import neoflow
from neoflow.autodiff import grad
from neoflow.ir.expr import Reduce, index_variables, reductions
from neoflow.ir.factor import hoist_invariant_factors
from neoflow.ir.interpreter import evaluate_op
from neoflow.ir.printer import to_text

SHAPES = {"G": (6, 3), "W": (3,), "X": (6, 3), "M": (3,), "V": (3,)}
# a BatchNorm variance's adjoint as the training graph derives it
VARIANCE_ADJOINT = "Y[c] = ReduceAdd({n}, G[n, c] * -(W[c] * 0.5 * (X[n, c] - M[c]) / pow(V[c] + 0.00001, 1.5)))"


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {name: rng.standard_normal(shape).astype(np.float64) for name, shape in SHAPES.items()}
    values["V"] = np.abs(values["V"]) + 0.5
    return values


def test_factors_of_the_output_index_alone_leave_the_sum_and_the_value_holds() -> None:
    op = neoflow.op(VARIANCE_ADJOINT, shapes=SHAPES, dtype="float64")
    hoisted = hoist_invariant_factors(op.body)
    (summed,) = reductions(hoisted)
    assert "pow" not in str(summed.body) and "W" not in {r.tensor for r in summed.body.reads()}
    assert index_variables(summed.body) == {"n", "c"}
    rewritten = neoflow.op(f"Y[c] = {to_text(hoisted)}", shapes=SHAPES, dtype="float64")
    values = _inputs()
    np.testing.assert_allclose(evaluate_op(rewritten, values), evaluate_op(op, values), rtol=1e-14)


def test_a_sum_guarded_by_an_output_index_or_of_constants_alone_stays_as_written() -> None:
    guarded = neoflow.op(
        "Y[i] = ReduceAdd({r | i >= 1}, D[i - 1] * W[i - 1, r])", shapes={"D": (4,), "W": (4, 3)}, dtype="float64"
    )
    assert hoist_invariant_factors(guarded.body) == guarded.body  # D[i - 1] is read only where i >= 1
    scaled = neoflow.op("Y[i] = ReduceAdd({r}, 0.5 * W[i, r])", shapes={"W": (4, 3)})
    assert hoist_invariant_factors(scaled.body) == scaled.body


def test_derived_adjoints_compute_the_factor_once_per_output_point() -> None:
    op = neoflow.op(VARIANCE_ADJOINT, shapes=SHAPES, dtype="float64")
    adjoint = grad(op)["V"]
    (summed,) = reductions(adjoint.body)
    assert isinstance(summed, Reduce) and "pow" not in str(summed.body)
    values = _inputs(1)
    values["dY"] = np.random.default_rng(2).standard_normal(3)
    # dY[c] * dY/dV[c] by central differences of the forward op
    step, numeric = 1e-6, np.zeros(3)
    for c in range(3):
        up, down = dict(values), dict(values)
        up["V"], down["V"] = values["V"].copy(), values["V"].copy()
        up["V"][c] += step
        down["V"][c] -= step
        numeric[c] = values["dY"][c] * (evaluate_op(op, up)[c] - evaluate_op(op, down)[c]) / (2 * step)
    np.testing.assert_allclose(evaluate_op(adjoint, values), numeric, rtol=1e-7)
