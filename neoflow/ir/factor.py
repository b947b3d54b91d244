"""Factors a sum does not vary with, taken out of it: ``ReduceAdd({r}, a[r] * c[i] / d[i])`` is
``c[i] / d[i] * ReduceAdd({r}, a[r])``.

Derived adjoints are full of them: the adjoint of a BatchNorm's variance sums, over every element of a
channel, the output gradient times ``weight[c] * 0.5 * (x - mean[c]) / pow(var[c] + eps, 1.5)``, and
evaluated as written each element pays a ``pow`` (MobileNetV2's training step spent 25-29 ms on each
of three such sums, four times their bandwidth bound).  Taken out, the factor is computed once per
output point.  Exact in real arithmetic (distributivity); in floating point it rounds differently by
an ulp or so, as any reassociation does.
"""

from __future__ import annotations

from neoflow.ir.expr import Binary, Const, Expr, Index, Reduce, Unary, index_variables, map_children


def hoist_invariant_factors(node: Expr) -> Expr:
    """``node`` with every ``ReduceAdd`` whose body is a product (``*``, ``/``, unary ``-``) rewritten
    as the product of the factors that do not depend on its axes times the sum of the others — where
    some factor depends on them, some factor that does not is more than a constant, and the sum's domain
    restricts its axes alone (a ``where`` naming an output index guards reads of the factors too)."""

    def rewrite(n: Expr) -> Expr:
        n = map_children(n, rewrite)
        if not isinstance(n, Reduce) or n.kind != "ReduceAdd":
            return n
        axes = set(n.axes)
        if n.where is not None and index_variables(n.where) - axes:
            return n  # the sum is empty at some points, where a factor taken out may not be readable
        varying, fixed = [], []
        for f, p in _factors(n.body, 1):
            (varying if index_variables(f) & axes else fixed).append((f, p))
        if not varying or not any(not isinstance(f, (Const, Index)) for f, _ in fixed):
            return n
        body = _product(varying)
        if body.dtype != n.body.dtype:  # a sum of weakly typed factors: leave it as written
            return n
        summed = Reduce(n.kind, n.axes, n.extents, body, n.where)
        numerator = [f for f, p in fixed if p > 0]
        denominator = [f for f, p in fixed if p < 0]
        out: Expr = summed
        for f in numerator:
            out = Binary("*", f, out)
        for f in denominator:
            out = Binary("/", out, f)
        return out

    return rewrite(node)


def _factors(node: Expr, power: int) -> list[tuple[Expr, int]]:
    """``node`` as a product of factors, each with its power (1, or -1 for a divisor); ``-x`` gives the
    factor ``-1``."""
    if isinstance(node, Binary) and node.op == "*":
        return [*_factors(node.a, power), *_factors(node.b, power)]
    if isinstance(node, Binary) and node.op == "/" and node.dtype.startswith(("float", "bfloat")):
        return [*_factors(node.a, power), *_factors(node.b, -power)]
    if isinstance(node, Unary) and node.op == "-":
        return [(Const(-1), 1), *_factors(node.x, power)]
    return [(node, power)]


def _product(factors: list[tuple[Expr, int]]) -> Expr:
    """The product of ``factors`` (powers 1 and -1), in their order."""
    first, power = factors[0]
    out = first if power > 0 else Binary("/", Const(1.0), first)
    for f, p in factors[1:]:
        out = Binary("*" if p > 0 else "/", out, f)
    return out
