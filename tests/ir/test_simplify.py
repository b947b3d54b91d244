"""Range-aware simplification of index expressions: exact over the variables' box."""

from __future__ import annotations

import itertools

import numpy as np
import sympy
from hypothesis import example, given, settings
from hypothesis import strategies as st

import neoflow
from neoflow.ir import index
from neoflow.ir.expr import COMPARISONS, Binary, Const, Index, Read, Select, Unary
from neoflow.ir.index import flat_offset, var
from neoflow.ir.interpreter import _BINARY
from neoflow.ir.simplify import condition_value, fold_selects, interval, simplify_index, simplify_offset

i0, i1, i2, i3 = (var(f"i{d}") for d in range(4))


def _values_on_box(expr: sympy.Expr, extents: dict[str, int]) -> np.ndarray:
    names = sorted(extents)
    grids = np.meshgrid(*(np.arange(extents[n]) for n in names), indexing="ij")
    value = index.evaluate(expr, dict(zip(names, grids, strict=True)))
    return np.broadcast_to(np.asarray(value), grids[0].shape)


def test_a_reshape_that_only_adds_unit_dimensions_reads_its_input_directly() -> None:
    # the capsule network's x6 = Reshape(x, [32, 1, 8, 8, 1, 1])
    extents = {"i0": 32, "i2": 8, "i3": 8}
    assert simplify_index(sympy.Mod(i0 + sympy.floor((8 * i2 + i3) / 64), 32), extents) == i0
    assert simplify_index(sympy.Mod(i2 + sympy.floor(i3 / 8), 8), extents) == i2
    assert simplify_index(sympy.Mod(i3, 8), extents) == i3


def test_a_reshapes_digits_add_back_up_to_its_flat_index() -> None:
    # f[i0, i1] = c2[i0, i1//8 % 4, i1//4 % 2, i1//2 % 2, 0, i1 % 2] (c2 of shape 32, 4, 2, 2, 1, 2)
    extents = {"i0": 32, "i1": 32}
    digits = [
        i0,
        sympy.Mod(sympy.floor(i1 / 8), 4),
        sympy.Mod(sympy.floor(i1 / 4), 2),
        sympy.Mod(sympy.floor(i1 / 2), 2),
        sympy.Integer(0),
        sympy.Mod(i1, 2),
    ]
    assert [simplify_index(d, extents) for d in digits][:2] == [i0, sympy.floor(i1 / 8)]  # i1//8 < 4
    assert simplify_offset(flat_offset(digits, (32, 4, 2, 2, 1, 2)), extents) == 32 * i0 + i1


def test_what_the_box_does_not_decide_is_left_alone() -> None:
    extents = {"i0": 224, "i1": 9}
    for expr in (sympy.Mod(i0, 2), sympy.floor(i0 / 2), sympy.Mod(i0 + i1, 8), index.tensor_read("I", (i0,)) // 2):
        assert simplify_index(expr, extents) == expr
    # a remainder whose division stays is kept as written in an offset too
    assert simplify_offset(4 * sympy.Mod(i0, 2) + i1, extents) == 4 * sympy.Mod(i0, 2) + i1
    assert simplify_index(sympy.floor(sympy.floor(i0 / 4) / 2), extents) == sympy.floor(i0 / 8)
    assert interval(index.tensor_read("I", (i0,)), extents) is None
    assert interval(i0 + var("unknown"), extents) is None


_LEAVES = st.sampled_from([i0, i1, i2, sympy.Integer(3)])


def _expressions(leaves: st.SearchStrategy) -> st.SearchStrategy:
    constants = st.integers(1, 9)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda ab: ab[0] + ab[1]),
            st.tuples(inner, constants).map(lambda ac: ac[0] * ac[1]),
            st.tuples(inner, constants).map(lambda ac: sympy.floor(ac[0] / ac[1])),
            st.tuples(inner, constants).map(lambda ac: sympy.Mod(ac[0], ac[1])),
        ),
        max_leaves=6,
    )


@settings(max_examples=150, deadline=None)
@given(expr=_expressions(_LEAVES), sizes=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)))
def test_simplified_expressions_equal_the_original_at_every_point_of_the_box(expr, sizes) -> None:
    extents = dict(zip(("i0", "i1", "i2"), sizes, strict=True))
    expected = _values_on_box(expr, extents)
    np.testing.assert_array_equal(_values_on_box(simplify_index(expr, extents), extents), expected)
    np.testing.assert_array_equal(_values_on_box(simplify_offset(expr, extents), extents), expected)
    bounds = interval(expr, extents)
    assert bounds is not None and bounds[0] <= expected.min() and expected.max() <= bounds[1]


def test_ops_are_built_and_inlined_with_their_indices_simplified() -> None:
    graph = neoflow.graph(
        """
        x = tensor([4, 1, 3, 3])
        w = tensor([9, 5])
        f = tensor([4, 9])
        f[n, j] = x[(n*9 + j)//9 % 4, 0, (n*9 + j)//3 % 3, (n*9 + j) % 3]
        y[n, k] = ReduceAdd({j}, f[n, j] * w[j, k])
        """
    )
    f, y = graph.ops
    assert str(f) == "f[n, j] = x[n, 0, j//3, j%3]"
    from neoflow.fusion.inline import inline

    fused = inline(y, f)
    assert "x[n, 0, j//3, j%3]" in str(fused)
    read = next(node for node in fused.body.walk() if getattr(node, "tensor", None) == "x")
    assert simplify_offset(flat_offset(read.indices, (4, 1, 3, 3)), fused.extent) == 9 * var("n") + var("j")


def test_every_point_of_a_small_box_checks_the_capsule_reshape_read() -> None:
    # the convolution reading the reshape inlined: (b + (8*p + q + 8*r + s)//64) % 32 with p + r, q + s < 8
    extents = {"b": 2, "p": 6, "q": 6, "r": 3, "s": 3}
    b, p, q, r, s = (var(v) for v in extents)
    expr = sympy.Mod(b + sympy.floor((8 * p + q + 8 * r + s) / 64), 32)
    assert simplify_index(expr, extents) == b
    for point in itertools.product(*(range(e) for e in extents.values())):
        env = dict(zip(extents, point, strict=True))
        assert index.evaluate(expr, env) == env["b"]


_COMPARE = {op: _BINARY[op] for op in COMPARISONS}  # the interpreter's numpy comparisons


@settings(max_examples=150, deadline=None)
@example(left=i0, right=sympy.Mod(3 * sympy.Mod(i0, 3), 2), op="!=", sizes=(1, 1, 1))  # sympy writes a power
@given(
    left=_expressions(_LEAVES),
    right=_expressions(_LEAVES),
    op=st.sampled_from(sorted(_COMPARE)),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6)),
)
def test_a_condition_decided_over_the_box_holds_at_every_point_or_at_none(left, right, op, sizes) -> None:
    extents = dict(zip(("i0", "i1", "i2"), sizes, strict=True))
    holds = _COMPARE[op](_values_on_box(left, extents), _values_on_box(right, extents))
    cond = Binary(op, Index(left), Index(right))
    for whole in (cond, Unary("!", cond), Binary("&&", cond, Const(True)), Binary("||", cond, Const(False))):
        value = condition_value(whole, extents)
        expected = ~holds if isinstance(whole, Unary) else holds
        if value is not None:
            assert bool(expected.all()) if value else not expected.any()
    # what the box can decide, it does: a comparison of one variable with a constant
    if left.is_Symbol and right.is_Integer:
        assert (condition_value(cond, extents) is None) == (0 < holds.sum() < holds.size)


def test_a_select_the_box_decides_is_the_branch_it_takes() -> None:
    c = var("c")
    concat = Select(Binary("<", Index(c), Const(3)), Read("A", (c,), "float32"), Read("E", (c - 3,), "float32"))
    assert fold_selects(concat, {"c": 3}) == concat.a  # read for c < 3 only: A
    assert fold_selects(concat, {"c": 7}) == concat  # both parts
    shifted = Select(Binary("<", Index(c + 3), Const(3)), Read("A", (c,), "float32"), Read("E", (c,), "float32"))
    assert fold_selects(shifted, {"c": 4}) == shifted.b  # never below 3: E
    # a branch of another dtype is left in its select (the select's dtype is the promoted one)
    mixed = Select(Binary("<", Index(c), Const(3)), Const(1), Read("E", (c,), "float32"))
    assert fold_selects(mixed, {"c": 3}) == mixed
    # a condition on data is not decided
    on_data = Select(Binary("<", Read("I", (c,), "float32"), Const(3)), Const(1.0), Const(0.0))
    assert condition_value(on_data.cond, {"c": 3}) is None and fold_selects(on_data, {"c": 3}) == on_data


def test_a_clamp_that_cannot_change_a_comparison_is_dropped() -> None:
    from neoflow.ir.expr import Binary, Const, Read
    from neoflow.ir.simplify import drop_idle_clamps

    x = Read("X", (sympy.Symbol("i", integer=True),), "float32")
    relu6 = Binary("min", Binary("max", x, Const(0.0)), Const(6.0))
    assert drop_idle_clamps(Binary("<", relu6, Const(6.0))) == Binary("<", x, Const(6.0))
    assert drop_idle_clamps(Binary(">", relu6, Const(0.0))) == Binary(">", x, Const(0.0))
    assert drop_idle_clamps(Binary(">=", Binary("max", Const(0.0), x), Const(1.0))) == Binary(">=", x, Const(1.0))
    assert drop_idle_clamps(Binary("<", relu6, Const(5.0))) == Binary("<", x, Const(5.0))
    for kept in (Binary("<=", relu6, Const(6.0)), Binary(">", Binary("max", x, Const(0.0)), Const(-1.0))):
        assert drop_idle_clamps(kept) == kept  # the clamp decides these (always true): left alone
    values = np.array([-2.0, 0.0, 3.0, 6.0, 9.0, np.nan], np.float32)
    for op in ("<", "<=", ">", ">="):
        for limit in (-1.0, 0.0, 3.0, 6.0, 7.0):
            for clamp in ("min", "max"):
                for k in (0.0, 6.0):
                    expr = Binary(op, Binary(clamp, x, Const(k)), Const(limit))
                    clamped = (np.minimum if clamp == "min" else np.maximum)(values, k)
                    compare = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}[op]
                    simplified = drop_idle_clamps(expr)
                    if simplified != expr:  # x compared directly: the same answer at every value, NaN too
                        np.testing.assert_array_equal(compare(values, limit), compare(clamped, limit))
