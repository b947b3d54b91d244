"""Range-aware simplification of index expressions.

A reshape reads its input through floor divisions and remainders of a flat
index (``x[(64*i0 + 8*i2 + i3)//64 % 32, ...]``); where the index variables'
ranges keep a division's argument inside one block, the division is a constant
and the remainder its argument shifted (``i0`` above, for ``i2, i3 < 8``).
Simplified, such reads are affine: the code generator copies them with vector
loads and isl sees plain bounds.  Every rewrite holds at every point of the box
``0 <= v < extent`` of the variables, so it holds wherever the op evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from neoflow.ir import index
from neoflow.ir.expr import COMPARISONS, Binary, Const, Expr, Index, Select, Unary, map_children

Interval = tuple[sympy.Rational, sympy.Rational]


def interval(expr: sympy.Expr, extents: Mapping[str, int]) -> Interval | None:
    """The least and greatest value of ``expr`` over the box of ``extents``
    (each variable in ``[0, extent)``), by interval arithmetic; None where a
    variable has no extent or a term is not bounded (a data-dependent read)."""
    if expr.is_Number:
        return expr, expr
    if expr.is_Symbol:
        extent = extents.get(expr.name)
        return None if extent is None or extent < 1 else (sympy.Integer(0), sympy.Integer(extent - 1))
    if expr.is_Add or expr.is_Mul:
        parts = [interval(arg, extents) for arg in expr.args]
        if any(part is None for part in parts):
            return None
        low, high = parts[0]
        for a, b in parts[1:]:
            if expr.is_Add:
                low, high = low + a, high + b
            else:
                corners = (low * a, low * b, high * a, high * b)
                low, high = min(corners), max(corners)
        return low, high
    if isinstance(expr, sympy.floor):
        inner = interval(expr.args[0], extents)
        return None if inner is None else (sympy.floor(inner[0]), sympy.floor(inner[1]))
    if isinstance(expr, sympy.Mod):
        divisor = expr.args[1]
        if not (divisor.is_Integer and divisor > 0):
            return None
        inner = interval(expr.args[0], extents)
        block = _one_block(inner, divisor)
        if block is not None:
            return inner[0] - divisor * block, inner[1] - divisor * block
        return sympy.Integer(0), divisor - 1
    return None


def simplify_index(expr: sympy.Expr, extents: Mapping[str, int]) -> sympy.Expr:
    """``expr`` with every floor division and remainder that the box of ``extents``
    decides rewritten: a division whose argument stays inside one block is that
    block's number, a remainder of such an argument is the argument shifted, and a
    division of a division is one division (``(x//4)//2 = x//8``)."""
    if not expr.has(sympy.floor, sympy.Mod):
        return expr

    def rewrite(node: sympy.Expr) -> sympy.Expr:
        if not node.args or not node.has(sympy.floor, sympy.Mod):
            return node
        node = node.func(*(rewrite(arg) for arg in node.args))
        if isinstance(node, sympy.floor):
            return _floor(node.args[0], extents)
        if isinstance(node, sympy.Mod):
            return _mod(node.args[0], node.args[1], extents)
        return node

    return rewrite(expr)


def simplify_offset(expr: sympy.Expr, extents: Mapping[str, int]) -> sympy.Expr:
    """A flat offset simplified as far as the box allows: remainders the box does not
    decide are written ``x - m*(x//m)`` so that a reshape's digits add back up to the
    index they came from (``8*(j//8) + 4*(j//4 % 2) + 2*(j//2 % 2) + j % 2 = j``).
    Where some division stays, the offset is ``simplify_index``'s."""
    simple = simplify_index(expr, extents)
    if not simple.has(sympy.Mod):
        return sympy.expand(simple)

    def expand_mod(node: sympy.Expr) -> sympy.Expr:
        if not node.args:
            return node
        node = node.func(*(expand_mod(arg) for arg in node.args))
        if isinstance(node, sympy.Mod) and node.args[1].is_Integer and node.args[1] > 0:
            x, m = node.args
            return x - m * _floor(x / m, extents)
        return node

    digits = sympy.expand(simplify_index(expand_mod(simple), extents))
    return digits if not digits.has(sympy.floor, sympy.Mod) else sympy.expand(simple)


def read_offset(indices: Sequence[sympy.Expr], shape: Sequence[int], extents: Mapping[str, int]) -> sympy.Expr:
    """The flat offset of a read at ``indices`` of a tensor of ``shape``, simplified over
    the box of ``extents`` (``simplify_offset``)."""
    return simplify_offset(index.flat_offset(indices, shape), extents)


def _floor(argument: sympy.Expr, extents: Mapping[str, int]) -> sympy.Expr:
    """``floor(argument)`` simplified (``argument`` integer-valued terms over a constant)."""
    block = _one_block(interval(argument, extents), 1)
    if block is not None:
        return block
    denominator = index.denominator(argument)
    numerator = sympy.expand(argument * denominator)
    if isinstance(numerator, sympy.floor) and denominator > 1:
        # (y // b) // d = y // (b * d) for positive integers b and d
        return _floor(numerator.args[0] / denominator, extents)
    return sympy.floor(argument)


def _mod(value: sympy.Expr, divisor: sympy.Expr, extents: Mapping[str, int]) -> sympy.Expr:
    """``value % divisor`` simplified where the box keeps ``value`` in one block."""
    if not (divisor.is_Integer and divisor > 0):
        return sympy.Mod(value, divisor)
    block = _one_block(interval(value, extents), divisor)
    if block is not None:
        return sympy.expand(value - divisor * block)
    return sympy.Mod(value, divisor)


def _one_block(bounds: Interval | None, divisor: sympy.Expr) -> sympy.Expr | None:
    """The number of the one block of ``divisor`` consecutive integers that values
    within ``bounds`` lie in (their floor division by ``divisor``), or None."""
    if bounds is None:
        return None
    block = sympy.floor(bounds[0] / divisor)
    return block if block == sympy.floor(bounds[1] / divisor) else None


def _index_value(node: Expr) -> sympy.Expr | None:
    if isinstance(node, Index):
        return node.expr
    if isinstance(node, Const) and not isinstance(node.value, bool):
        return sympy.sympify(node.value)
    return None


def condition_value(cond: Expr, extents: Mapping[str, int]) -> bool | None:
    """Whether ``cond`` (comparisons of index expressions joined by ``&&``,
    ``||`` and ``!``) holds at every point of the box of ``extents`` (True), at
    none (False), or None: it depends on the point, or on data."""
    if isinstance(cond, Const) and isinstance(cond.value, bool):
        return cond.value
    if isinstance(cond, Unary) and cond.op == "!":
        inner = condition_value(cond.x, extents)
        return None if inner is None else not inner
    if not isinstance(cond, Binary):
        return None
    if cond.op in ("&&", "||"):
        a, b = condition_value(cond.a, extents), condition_value(cond.b, extents)
        decisive = cond.op == "||"  # the value of one side that decides the whole
        if a is decisive or b is decisive:
            return decisive
        return None if a is None or b is None else not decisive
    left, right = _index_value(cond.a), _index_value(cond.b)
    if cond.op not in COMPARISONS or left is None or right is None:
        return None
    bounds = interval(sympy.expand(left - right), extents)
    if bounds is None:
        return None
    low, high = bounds
    always, never = {
        "<": (high < 0, low >= 0),
        "<=": (high <= 0, low > 0),
        ">": (low > 0, high <= 0),
        ">=": (low >= 0, high < 0),
        "==": (low == high == 0, low > 0 or high < 0),
        "!=": (low > 0 or high < 0, low == high == 0),
    }[cond.op]
    return True if always else False if never else None


def fold_selects(node: Expr, extents: Mapping[str, int]) -> Expr:
    """``node`` with every ``Select`` whose condition is decided over the box of
    ``extents`` (``condition_value``) replaced by the branch it takes, where that
    branch has the ``Select``'s dtype: ``F[c] = Select(c < 3, A[c], E[c - 3])``
    read for ``c < 3`` only is ``A[c]``, and reads nothing of ``E``."""

    def fold(n: Expr) -> Expr:
        n = map_children(n, fold)
        if isinstance(n, Select):
            taken = condition_value(n.cond, extents)
            branch = None if taken is None else n.a if taken else n.b
            if branch is not None and branch.dtype == n.dtype:
                return branch
        return n

    return fold(node)


#: ``min(u, k) op c`` and ``max(u, k) op c`` that are ``u op c`` for constants ``k`` and ``c``: per comparison,
#: the condition on ``k`` and ``c`` under which the clamp does not change the comparison
_CLAMP_IDLE = {
    ("min", "<"): lambda k, c: k >= c,
    ("min", "<="): lambda k, c: k > c,
    ("min", ">"): lambda k, c: k > c,
    ("min", ">="): lambda k, c: k >= c,
    ("max", "<"): lambda k, c: k < c,
    ("max", "<="): lambda k, c: k <= c,
    ("max", ">"): lambda k, c: k <= c,
    ("max", ">="): lambda k, c: k < c,
}


def _number(node: Expr) -> float | None:
    """The value of a numeric literal (not a bool), else None."""
    if isinstance(node, Const) and not isinstance(node.value, bool) and isinstance(node.value, int | float):
        return float(node.value)
    return None


def drop_idle_clamps(node: Expr) -> Expr:
    """``node`` with every comparison of a clamp against a constant that the clamp cannot change
    compared without it: ``min(max(x, 0), 6) < 6`` is ``x < 6`` (a ReLU6's derivative recomputed
    from its input).  Exact for every ``x``, NaN included (a NaN compares false both ways)."""

    def drop(n: Expr) -> Expr:
        n = map_children(n, drop)
        if not (isinstance(n, Binary) and n.op in COMPARISONS):
            return n
        clamp, limit = n.a, _number(n.b)
        if limit is None or not (isinstance(clamp, Binary) and clamp.op in ("min", "max")):
            return n
        for inner, bound in ((clamp.a, clamp.b), (clamp.b, clamp.a)):
            k = _number(bound)
            idle = _CLAMP_IDLE.get((clamp.op, n.op))
            if k is not None and idle is not None and idle(k, limit):
                return drop(Binary(n.op, inner, n.b))
        return n

    return drop(node)
