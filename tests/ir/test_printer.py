"""The printer writes ops in the text language, and parse(print(op)) == op."""

from pathlib import Path

import pytest

import neoflow
from neoflow.ir import Op

from .test_seed import CAPSULE, CONCAT, D2S, DILATED, PAD, QUASI

MODELS = Path(__file__).resolve().parents[2] / "models"

CASES = [
    (PAD, {"A": (1, 3, 224, 224), "B": (1, 3, 228, 228)}),
    (DILATED, {"B": (1, 3, 228, 228), "C": (64, 3, 3, 3)}),
    (D2S, {"D": (1, 64, 112, 112)}),
    (CONCAT, {"A": (1, 3, 224, 224), "E": (1, 16, 224, 224)}),
    (CAPSULE, {"A": (2, 3, 9, 9, 4, 4), "B": (5, 3, 3, 3, 4, 4)}),
    (QUASI, {"In": (2, 3, 9, 7), "Weight": (4, 3, 3, 3)}),
    ("Y[n, c, p, q] = ReduceMax({r: 2, s: 2}, X[n, c, p*2+r, q*2+s])", {"X": (1, 2, 6, 6)}),
    ("Y[i] = exp(X[i] - 1.5e-3) / ReduceAdd({j}, exp(X[j] - 1.5e-3))", {"X": (5,)}),
    ("Y[i, j] = -X[i] * j + 0.5 - (i + 1)/2 * -2", {"X": (5,), "Y": (5, 3)}),
    ("Y[i] = Select(!(i > 0 && X[i] >= 0) || i == 3, float16(X[i]) * 2, -inf)", {"X": (5,)}),
    ("Y[i] = pow(abs(X[i]), 2.0) + max(sigmoid(X[i]), tanh(X[i])) - min(sqrt(abs(X[i])), log(2.0))", {"X": (4,)}),
    ("Y[i] = ReduceMul({j}, X[i, j]) + ReduceMin({k}, X[i, k] * (k - 2*(i%2)))", {"X": (3, 4)}),
    ("Y[i] += X[i, j] * W[j]", {"X": (3, 4), "W": (4,)}),
    ("Y[i] = X[idx[i] + 1]", {"X": (6,), "idx": (3,)}),
    ("Y[i, j] = X[i - j + 3, (2 - i)%3, -j + 4, (i + 2*j)//3]", {"X": (8, 3, 6, 4), "Y": (3, 3)}),
]


def reparse(op: Op) -> Op:
    shapes = {t.name: t.shape for t in op.inputs} | {op.name: op.shape}
    dtypes = {t.name: t.dtype for t in op.inputs} | {op.name: op.dtype}
    return neoflow.op(str(op), shapes=shapes, dtypes=dtypes)


@pytest.mark.parametrize(("text", "shapes"), CASES)
def test_parse_print_round_trip(text: str, shapes: dict) -> None:
    op = neoflow.op(text, shapes=shapes, dtypes={"idx": "int32"})
    again = reparse(op)
    assert again == op
    assert str(again) == str(op)


def test_seed_running_example_prints_in_the_seed_shape() -> None:
    op = neoflow.op(QUASI, shapes={"In": (2, 3, 9, 7), "Weight": (4, 3, 3, 3)})
    assert str(op) == "Out[b, k, p, q] = ReduceAdd({c, r, s}, In[b, c, 2*p + r, s + q//2] * Weight[k, c, r, s])"


def test_implicit_reduction_axis_is_printed() -> None:
    op = neoflow.op(DILATED, shapes={"B": (1, 3, 228, 228), "C": (64, 3, 3, 3)})
    assert str(op).startswith("D[n, k, p, q] = ReduceAdd({r, s, c}, ")


def test_graph_round_trip() -> None:
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    assert neoflow.graph(str(graph)) == graph


def test_different_ops_differ() -> None:
    a = neoflow.op("Y[i] = X[i] * 2", shapes={"X": (3,)})
    assert a != neoflow.op("Y[i] = X[i] * 3", shapes={"X": (3,)})
    assert a != neoflow.op("Y[i] = X[i] * 2", shapes={"X": (3,)}, dtype="float64")
