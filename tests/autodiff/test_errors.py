"""What autodiff cannot invert is an autodiff error naming the op and the read."""

import pytest

import neoflow
from neoflow.autodiff import grad
from neoflow.errors import NonInvertibleMapError


def test_non_affine_read_next_to_another_read_is_an_error() -> None:
    op = neoflow.op("Y[i, j] = X[idx[i], j] + X[i, j]", shapes={"X": (4, 3), "idx": (4,)}, dtypes={"idx": "int64"})
    with pytest.raises(NonInvertibleMapError) as info:
        grad(op, "X")
    message = str(info.value)
    assert message.startswith("autodiff error: op 'Y': cannot invert the index map of read X[idx[i], j]")
    assert "scatter-add fallback needs it to be the only read of 'X'" in message and "\n" not in message


def test_single_non_affine_read_falls_back_to_a_marked_scatter() -> None:
    op = neoflow.op("Y[i, j] = X[i*j]", shapes={"X": (10,), "Y": (3, 4)})
    adjoint = grad(op)["X"]
    assert adjoint.info.kind == "scatter" and "'i*j' is not affine" in adjoint.info.reason
    assert str(adjoint) == "dX[i*j] += dY[i, j]"


def test_unknown_wrt_is_an_error() -> None:
    op = neoflow.op("Y[i] = X[i] * 2", shapes={"X": (3,)})
    with pytest.raises(NonInvertibleMapError, match=r"'Z' is not an input of the op \(inputs: X\)"):
        grad(op, "Z")


def test_integer_inputs_are_not_differentiated_by_default() -> None:
    op = neoflow.op("Y[i] = X[idx[i]] * 2", shapes={"X": (5,), "idx": (3,)}, dtypes={"idx": "int32"})
    assert set(grad(op)) == {"X"}


def test_input_read_only_in_a_condition_has_a_zero_adjoint() -> None:
    op = neoflow.op("Y[i] = Select(M[i] > 0, X[i], 0)", shapes={"X": (3,), "M": (3,)})
    assert str(grad(op, "M")["M"]) == "dM[z1] = 0"
