"""Malformed text is rejected with a message naming the problem, the op and its line/column."""

import pytest

import neoflow
from neoflow.errors import InputError, ParseError, ShapeError

MATMUL_SHAPES = {"A": (3, 4), "B": (4, 5)}


def error_of(text: str, shapes: dict, **kwargs) -> neoflow.NeoflowError:
    with pytest.raises(neoflow.NeoflowError) as info:
        neoflow.op(text, shapes=shapes, **kwargs)
    return info.value


def test_unclosed_bracket() -> None:
    err = error_of("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j]", MATMUL_SHAPES)
    assert isinstance(err, ParseError)
    assert (err.line, err.column) == (1, 20)
    assert "'(' is never closed" in str(err) and "line 1, column 20" in str(err)


def test_mismatched_closing_bracket() -> None:
    err = error_of("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j)", MATMUL_SHAPES)
    assert isinstance(err, ParseError)
    assert (err.line, err.column) == (1, 42)
    assert "unexpected ')'" in str(err) and "'[' at line 1, column 37 is still open" in str(err)


def test_unknown_tensor() -> None:
    err = error_of("C[i, j] = ReduceAdd({k}, A[i, k] * X[k, j])", MATMUL_SHAPES)
    assert isinstance(err, ParseError)
    assert (err.op, err.line, err.column) == ("C", 1, 36)
    assert "unknown tensor 'X'" in str(err)


def test_wrong_number_of_indices() -> None:
    err = error_of("C[i, j] = ReduceAdd({k}, A[i, k] * B[k])", MATMUL_SHAPES)
    assert isinstance(err, ShapeError)
    assert (err.line, err.column) == (1, 36)
    assert "wrong number of indices for 'B': it has 2 dimensions, 1 given" in str(err)


def test_variable_with_no_inferable_range() -> None:
    err = error_of("Y[i] = ReduceMax({r}, X[2*i + r])", {"X": (10,)})
    assert isinstance(err, ShapeError)
    assert (err.line, err.column) == (1, 19)
    assert "cannot infer the range of reduction variable 'r'" in str(err) and "{r: N}" in str(err)


def test_unbounded_output_variable() -> None:
    err = error_of(
        "B[n, c, h, w] = Select(h>2 && h<226 && w>2 && w<226, A[n, c, h-2, w-2], 0)", {"A": (1, 3, 224, 224)}
    )
    assert isinstance(err, ShapeError)
    assert "output variables 'h', 'w'" in str(err) and "give the output shape" in str(err)
    assert (err.line, err.column) == (1, 9)


def test_shape_mismatch_between_two_uses_of_a_variable() -> None:
    err = error_of("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (3, 4), "B": (5, 6)})
    assert isinstance(err, ShapeError)
    assert (err.line, err.column) == (1, 36)
    assert "shape mismatch for variable 'k': A dim 1 gives 4 but B dim 0 gives 5" in str(err)


def test_shape_mismatch_of_an_output_variable() -> None:
    err = error_of("C[i] = A[i] + B[i]", {"A": (3,), "B": (4,)})
    assert "shape mismatch for variable 'i'" in str(err)


def test_output_shape_larger_than_a_direct_use() -> None:
    err = error_of("C[i] = A[i] * 2", {"A": (3,), "C": (4,)})
    assert "read A[i] is out of bounds at i=3: index 0 is 3 but 'A' has size 3 there" in str(err)


def test_read_out_of_bounds_names_a_point() -> None:
    err = error_of("B = tensor([4])\nC[i] = Select(i < 2,\n   A[i], B[i+5])", {"A": (4,), "C": (4,)})
    assert isinstance(err, ShapeError)
    assert (err.line, err.column) == (3, 10)
    assert "read B[i + 5] is out of bounds at i=" in str(err)


def test_free_variable_without_reduction() -> None:
    err = error_of("C[i] = A[i, j]", {"A": (3, 4)})
    assert (err.line, err.column) == (1, 13)
    assert "variable 'j' is not an output index and no reduction encloses all its uses" in str(err)


def test_ambiguous_variable() -> None:
    err = error_of("C[i] = ReduceAdd({i}, A[i])", {"A": (3,)})
    assert "variable 'i' is ambiguous" in str(err)
    err = error_of("C[i] = ReduceAdd({j}, A[j] * ReduceMax({k}, A[k] + B[j] * B[k + j]))", {"A": (3,), "B": (3,)})
    assert "read B[j + k] is out of bounds" in str(err)
    err = error_of("C[i] = ReduceAdd({j}, A[j] * ReduceMax({k}, A[k] + j * k) + B[k])", {"A": (3,), "B": (3,)})
    assert "variable 'k' is ambiguous: a reduction over it is nested in another one" in str(err)


def test_sibling_reductions_may_share_an_axis_name() -> None:
    op = neoflow.op("C[i] = ReduceAdd({j}, A[i, j]) + ReduceMax({j}, A[i, j])", shapes={"A": (2, 3)})
    assert op.reduce_axes == ("j",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("C[i] = A[i] $ 2", "unexpected character '$'"),
        ("C[i] = = A[i]", "expected an expression, found '='"),
        ("C[i] = foo(A[i])", "unknown function 'foo'"),
        ("C[i] = A[i * 0.5]", "index 0.5 is not an integer"),
        ("C[i] += A[i // j] * B[j]", "needs a positive integer constant"),
        ("C[i] = exp(A[i], A[i])", "exp takes 1 argument, 2 given"),
        ("C[i, i] = A[i]", "output index 'i' appears twice"),
        ("C[i] = A", "tensor 'A' is used without indices"),
        ("C[i] = A[i] + C[i]", "reads its own output"),
        ("C[i] = A[i]\nD[i] = A[i]", "expected one statement"),
    ],
)
def test_other_malformed_text(text: str, message: str) -> None:
    assert message in str(error_of(text, {"A": (3,), "B": (3,)}))


def test_graph_errors() -> None:
    with pytest.raises(ShapeError, match="cycle"):
        neoflow.graph("X[i] = Y[i] + A[i]\nY[i] = X[i]", shapes={"A": (3,), "X": (3,), "Y": (3,)})
    with pytest.raises(ShapeError, match="defined twice"):
        neoflow.graph("X[i] = A[i]\nX[i] = A[i]", shapes={"A": (3,)})
    with pytest.raises(ShapeError, match="declared with shape"):
        neoflow.graph("A = tensor([4])\nX[i] = A[i]", shapes={"A": (3,)})


def test_inputs_are_checked() -> None:
    import numpy as np

    op = neoflow.op("C[i] = A[i] * 2", shapes={"A": (3,)})
    with pytest.raises(InputError, match="missing input 'A'"):
        neoflow.evaluate(op, {})
    with pytest.raises(InputError, match=r"input 'A' has shape \[4\], expected \[3\]"):
        neoflow.evaluate(op, {"A": np.zeros(4)})


def test_errors_print_as_one_line() -> None:
    err = error_of("Y[i] = ReduceMax({r},\n   X[2*i + r])", {"X": (10,)})
    assert "\n" not in str(err)
    assert str(err).startswith("shape error: op 'Y', line 1, column 19: ")
