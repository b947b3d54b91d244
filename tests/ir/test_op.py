"""Renaming an op's index variables: copies of one computation over variables named apart come out
equal, and compute what the original computes."""

from __future__ import annotations

import numpy as np

import neoflow
from neoflow.ir.op import positional_variables, rename_variables

CONV = (
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 6 && q + s - 1 >= 0 && "
    "q + s - 1 < 6, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
)
SHAPES = {"X": (2, 3, 6, 6), "W": (4, 3, 3, 3)}


def test_copies_over_variables_named_apart_come_out_equal() -> None:
    op = neoflow.op(CONV, shapes=SHAPES, out_shape=(2, 4, 6, 6))
    renamed = neoflow.op(
        CONV.replace("p", "row")
        .replace("q", "col")
        .replace("{c, r, s}", "{ch, r, s}")
        .replace("[k, c,", "[k, ch,")
        .replace("X[n, c,", "X[n, ch,"),
        shapes=SHAPES,
        out_shape=(2, 4, 6, 6),
    )
    assert op != renamed
    assert positional_variables(op) == positional_variables(renamed)
    assert positional_variables(op).indices == ("_i0", "_i1", "_i2", "_i3")
    assert [v for v, _ in positional_variables(op).ranges][4:] == ["_r0", "_r1", "_r2"]


def test_a_renamed_op_computes_the_same() -> None:
    op = neoflow.op(CONV, shapes=SHAPES, out_shape=(2, 4, 6, 6))
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    want = neoflow.evaluate(op, inputs)
    np.testing.assert_array_equal(neoflow.evaluate(positional_variables(op), inputs), want)
    # renamed all at once: exchanging two names is no chain of renames
    swapped = rename_variables(op, {"r": "s", "s": "r"})
    np.testing.assert_array_equal(neoflow.evaluate(swapped, inputs), want)
    assert rename_variables(op, {}) is op
