"""Reduction axes stepped by divisibility conditions: only the points that can satisfy the condition.

A gather-form adjoint (a reshape's, a strided op's) sums over a domain whose
condition ``(c * axis + rest) % modulus == 0`` pins an axis to one residue: a
loop over that axis visits ``start, start + modulus, ...`` instead of every point.
Target independent: the CUDA emitter's loops and the NPU's vector steps both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from neoflow.ir import index
from neoflow.ir.expr import Const


@dataclass(frozen=True)
class StridedAxis:
    """A reduction axis a divisibility condition ``(c * axis + rest) % modulus == 0`` (``c`` = ±1)
    steps: it runs from ``(-c * rest) mod modulus`` in steps of ``modulus``."""

    axis: str
    rest: sympy.Expr
    sign: int
    modulus: int


def strided_axes(reduce, extent: dict[str, int]) -> tuple[StridedAxis, ...]:
    """The axes of ``reduce`` that divisibility conjuncts of its domain condition step (each
    conjunct at most one axis, one whose coefficient is ±1 and which the remainder does not
    name); a loop over such an axis visits only the points that can satisfy it (a reshape's
    adjoint otherwise tries every one of a 576 x 48 domain for its one term)."""
    from neoflow.ir.expr import Binary, Index, conjuncts

    if reduce.where is None:
        return ()
    found: dict[str, StridedAxis] = {}
    for part in conjuncts(reduce.where):
        if not (
            isinstance(part, Binary)
            and part.op == "=="
            and isinstance(part.a, Index)
            and isinstance(part.a.expr, sympy.Mod)
            and isinstance(part.b, Const)
            and part.b.value == 0
        ):
            continue
        expr, modulus = part.a.expr.args
        if not modulus.is_Integer or int(modulus) < 2:
            continue
        expr = sympy.expand(expr)
        for axis in reduce.axes:
            symbol = index.var(axis)
            coefficient = expr.coeff(symbol)
            rest = sympy.expand(expr - coefficient * symbol)
            if axis in found or coefficient not in (1, -1) or rest.has(symbol) or extent[axis] < 2:
                continue
            if not expr.is_polynomial(symbol):
                continue
            found[axis] = StridedAxis(axis, rest, int(coefficient), int(modulus))
            break
    return tuple(found.values())


def loop_order(reduce, extent: dict[str, int]) -> list[tuple[str, StridedAxis | None]]:
    """The loops of ``reduce``'s axes: plain ones first, then strided ones, each after the axes
    its start depends on (None where that cannot be ordered: every axis plain)."""
    strided = {s.axis: s for s in strided_axes(reduce, extent)}
    order: list[tuple[str, StridedAxis | None]] = [(a, None) for a in reduce.axes if a not in strided]
    pending = dict(strided)
    while pending:
        ready = [a for a, s in pending.items() if {v.name for v in s.rest.free_symbols} & set(pending) <= {a}]
        if not ready:
            return [(a, None) for a in reduce.axes]
        order += [(axis, pending.pop(axis)) for axis in ready]
    return order
