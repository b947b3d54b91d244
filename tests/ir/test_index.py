"""Index expressions: isl conversion, numpy evaluation and printing."""

import numpy as np
import pytest
import sympy

import neoflow
from neoflow.ir import index
from neoflow.ir.index import floordiv, mod, var
from tests.on_targets import TARGETS, evaluate_on

p, q, r, h, w = (var(n) for n in "pqrhw")


@pytest.mark.parametrize(
    ("expr", "isl_text"),
    [
        (2 * p + 2 * r, "((2*p) + (2*r))"),
        (floordiv(q, 2), "floor((q)/2)"),
        (mod(h, 2), "((h) mod 2)"),
        (floordiv(p - r, 3), "floor(((p + (-1*r)))/3)"),
        (p * r, None),
        (index.tensor_read("idx", (p,)), None),
    ],
)
def test_to_isl(expr, isl_text) -> None:
    assert index.to_isl(expr) == isl_text
    assert index.is_quasi_affine(expr) == (isl_text is not None)


def test_evaluate_matches_python_semantics() -> None:
    values = np.arange(-7, 8)
    for expr, fn in [
        (floordiv(p, 3), lambda v: v // 3),
        (mod(p, 3), lambda v: v % 3),
        (floordiv(2 * p + 1, 4) - mod(p + 5, 2) * 3, lambda v: (2 * v + 1) // 4 - (v + 5) % 2 * 3),
    ]:
        np.testing.assert_array_equal(index.evaluate(expr, {"p": values}), [fn(int(v)) for v in values])


def test_data_dependent_read_uses_the_reader() -> None:
    table = np.array([4, 1, 2])
    got = index.evaluate(index.tensor_read("idx", (p,)) + 1, {"p": np.arange(3)}, lambda name, ix: table[ix])
    np.testing.assert_array_equal(got, table + 1)


@pytest.mark.parametrize(
    "expr",
    [
        2 * p + 2 * r,
        floordiv(q, 2) + r,
        4 * var("c") + 2 * mod(h, 2) + mod(w, 2),
        p - r,
        -p + 3,
        2 * floordiv(h, 2),
        mod(h + 1, 3) * 2,
        floordiv(-p, 2),
        floordiv(p - r, 2),
        mod(3 * mod(h, 3), 2),  # sympy writes it Mod((h % 3)**2, 2)
    ],
)
def test_text_is_python_equivalent(expr) -> None:
    text = index.to_text(expr)
    for values in [(0, 0, 0, 0, 0, 0), (5, 3, 7, 2, 9, 4), (-3, 4, -5, 1, -2, 6)]:
        env = dict(zip(["p", "q", "r", "h", "w", "c"], values, strict=True))
        assert eval(text, {}, env) == int(index.evaluate(expr, env)), text


@pytest.mark.parametrize("target", TARGETS)
def test_a_product_sympy_writes_as_a_power_is_evaluated_printed_and_compiled(target: str) -> None:
    op = neoflow.op("Y[i] = X[(3*(i%3)) % 2 + i//3]", shapes={"X": (4,)}, out_shape=(9,))
    assert any(node.is_Pow for node in sympy.preorder_traversal(op.body.indices[0]))
    x = np.arange(4, dtype=np.float32) * 10
    np.testing.assert_array_equal(evaluate_on(target, op, {"X": x}), [x[(3 * (i % 3)) % 2 + i // 3] for i in range(9)])
    # its text reads back as the same op
    again = neoflow.op(str(op), shapes={"X": (4,)}, out_shape=(9,))
    np.testing.assert_array_equal(evaluate_on(target, again, {"X": x}), evaluate_on(target, op, {"X": x}))


def test_coefficient_answers_as_sympy_coeff() -> None:
    import sympy

    from neoflow.ir.index import coefficient, var

    i, j = var("i"), var("j")
    exprs = (3 * i + 4 * j - 7, i + 2 * i + j, 5 * i * j + i, sympy.floor(i / 2) + 3 * j, 2 * (i + j), sympy.Integer(4))
    for expr in exprs:
        for name in "ijk":
            assert coefficient(expr, name) == expr.coeff(var(name)), (expr, name)
