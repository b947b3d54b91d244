"""Index bounds with isl: which reads an op performs under which guards,
the ranges of output variables implied by those reads, and out-of-bounds checks.

A read inside a ``Select`` branch (or the right side of ``&&``/``||``) is only
performed where the guard lets it through; guards that are affine in the index
variables are passed to isl, others are treated as "may be true", which only
makes the checks stricter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import islpy as isl
import sympy

from neoflow.ir import index
from neoflow.ir.expr import Binary, Const, Expr, Index, Read, Reduce, Select, Unary, conjuncts

PREFIX = "v_"
_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Access:
    """A tensor read together with the (isl) condition under which it happens.

    ``guard`` is None when the read is unconditional or its guard is not affine;
    ``conditional`` says whether the read sits under any guard at all.
    """

    read: Read
    guard: str | None
    conditional: bool


def _isl_value(node: Expr) -> str | None:
    if isinstance(node, Index):
        return index.to_isl(node.expr, PREFIX)
    if isinstance(node, Const) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return str(node.value)
    return None


def condition_to_isl(cond: Expr, positive: bool = True) -> str | None:
    """isl text for ``cond`` (or its negation when ``positive`` is False) when it is
    affine in the index variables; None when it is not (read: "may be true")."""
    if isinstance(cond, Unary) and cond.op == "!":
        return condition_to_isl(cond.x, not positive)
    if isinstance(cond, Const) and isinstance(cond.value, bool):
        return "1 = 1" if cond.value == positive else "1 = 0"
    if not isinstance(cond, Binary):
        return None
    if cond.op in _NEGATE:
        a, b = _isl_value(cond.a), _isl_value(cond.b)
        if a is None or b is None:
            return None
        op = cond.op if positive else _NEGATE[cond.op]
        if op == "!=":
            return f"({a} < {b} or {a} > {b})"
        return f"{a} {'=' if op == '==' else op} {b}"
    if cond.op in ("&&", "||"):
        parts = [condition_to_isl(cond.a, positive), condition_to_isl(cond.b, positive)]
        conjunction = (cond.op == "&&") == positive
        if conjunction:
            known = [p for p in parts if p is not None]
            return " and ".join(f"({p})" for p in known) if known else None
        if None in parts:
            return None
        return " or ".join(f"({p})" for p in parts)
    return None


def _and(guard: str | None, extra: str | None) -> str | None:
    if extra is None:
        return guard
    return extra if guard is None else f"({guard}) and ({extra})"


def accesses(body: Expr) -> list[Access]:
    """Every read in ``body`` (nested index reads included) with its guard."""
    found: list[Access] = []

    def visit(node: Expr, guard: str | None, conditional: bool) -> None:
        if isinstance(node, Read):
            found.append(Access(node, guard, conditional))
            for i in node.indices:
                for call in index.data_reads(i):
                    nested = Read(call.func.__name__, tuple(call.args), "int64")
                    found.append(Access(nested, guard, conditional))
            return
        if isinstance(node, Select):
            visit(node.cond, guard, conditional)
            visit(node.a, _and(guard, condition_to_isl(node.cond, True)), True)
            visit(node.b, _and(guard, condition_to_isl(node.cond, False)), True)
            return
        if isinstance(node, Reduce) and node.where is not None:
            visit(node.where, guard, conditional)
            visit(node.body, _and(guard, condition_to_isl(node.where, True)), True)
            return
        if isinstance(node, Binary) and node.op in ("&&", "||"):
            visit(node.a, guard, conditional)
            visit(node.b, _and(guard, condition_to_isl(node.a, node.op == "&&")), True)
            return
        for child in node.children():
            visit(child, guard, conditional)

    visit(body, None, False)
    return found


def box_constraint(ranges: Mapping[str, int | None]) -> str:
    """isl text for ``0 <= v < extent`` (``v >= 0`` where the extent is None)."""
    parts = []
    for name, extent in ranges.items():
        v = PREFIX + name
        parts.append(f"{v} >= 0" if extent is None else f"0 <= {v} < {extent}")
    return " and ".join(parts) if parts else "1 = 1"


def _out_of_bounds(read: Read, shape: Sequence[int]) -> str | None:
    parts = []
    for expr, size in zip(read.indices, shape, strict=True):
        text = index.to_isl(expr, PREFIX)
        if text is not None:
            parts.append(f"({text} < 0 or {text} >= {size})")
    return " or ".join(parts) if parts else None


def make_set(variables: Sequence[str], constraint: str, hidden: Sequence[str] = ()) -> isl.Set:
    names = ", ".join(PREFIX + v for v in variables)
    if hidden:
        constraint = f"exists ({', '.join(PREFIX + h for h in hidden)} : {constraint})"
    return isl.Set(f"{{ [{names}] : {constraint} }}")


def _bad_points(
    access: Access,
    ranges: Mapping[str, int | None],
    shapes: Mapping[str, Sequence[int]],
    keep: Sequence[str],
    extra: str | None = None,
) -> isl.Set | None:
    oob = _out_of_bounds(access.read, shapes[access.read.tensor])
    if oob is None:
        return None
    constraint = _and(_and(_and(box_constraint(ranges), access.guard), extra), oob)
    hidden = [v for v in ranges if v not in keep]
    return make_set(keep, constraint or "1 = 1", hidden)


@dataclass(frozen=True)
class Violation:
    """A read that goes out of bounds at ``point`` in dimension ``dim``."""

    access: Access
    point: dict[str, int]
    dim: int
    value: int


def first_violation(
    all_accesses: Sequence[Access], ranges: Mapping[str, int], shapes: Mapping[str, Sequence[int]]
) -> Violation | None:
    """The first access that leaves its tensor somewhere in the box ``ranges``,
    with a point where it does; None when every access stays in bounds."""
    names = list(ranges)
    for access in all_accesses:
        bad = _bad_points(access, ranges, shapes, names)
        if bad is None or bad.is_empty():
            continue
        sample = bad.sample_point()
        point = {name: sample.get_coordinate_val(isl.dim_type.set, i).to_python() for i, name in enumerate(names)}
        shape = shapes[access.read.tensor]
        for dim, expr in enumerate(access.read.indices):
            if not index.is_quasi_affine(expr):
                continue
            value = int(index.evaluate(expr, point))
            if not 0 <= value < shape[dim]:
                return Violation(access, point, dim, value)
    return None


def infer_extents(
    all_accesses: Sequence[Access],
    ranges: Mapping[str, int | None],
    shapes: Mapping[str, Sequence[int]],
) -> dict[str, int | None]:
    """Extents of the variables whose range is None.

    Variable ``u`` gets the smallest value at which some read leaves its tensor
    while the other unknown variables are 0 and the known ones are anywhere in
    their ranges; None when no such value exists (nothing bounds ``u``).  The
    caller checks that the resulting box keeps every read in bounds."""
    unknown = [name for name, extent in ranges.items() if extent is None]
    result: dict[str, int | None] = {}
    for name in unknown:
        at_origin = " and ".join([f"{PREFIX}{v} = 0" for v in unknown if v != name] or ["1 = 1"])
        bad: isl.Set = make_set([name], "1 = 0")
        for access in all_accesses:
            points = _bad_points(access, ranges, shapes, [name], extra=at_origin)
            if points is not None:
                bad = bad.union(points)
        bad = bad.coalesce()
        result[name] = (
            None
            if bad.is_empty()
            else int(bad.lexmin().sample_point().get_coordinate_val(isl.dim_type.set, 0).to_python())
        )
    return result


def lattice_condition(part: Expr) -> tuple[sympy.Expr, int] | None:
    """``(e, m)`` for a conjunct ``e % m == 0`` with ``m > 1`` (either side order)."""
    if not (isinstance(part, Binary) and part.op == "=="):
        return None
    for left, right in ((part.a, part.b), (part.b, part.a)):
        if isinstance(right, Const) and right.value == 0 and isinstance(left, Index):
            expr = left.expr
            if isinstance(expr, sympy.Mod) and expr.args[1].is_Integer and int(expr.args[1]) > 1:
                return expr.args[0], int(expr.args[1])
    return None


def reduction_points(reduce: Reduce, extent: Mapping[str, int]) -> float:
    """About how many points ``reduce`` visits per output point: the box of its
    axes, thinned by each lattice condition ``e % m == 0`` of its domain to one
    point in ``m`` (bounds conditions are taken to hold)."""
    points = float(math.prod(extent[a] for a in reduce.axes))
    if reduce.where is not None:
        for part in conjuncts(reduce.where):
            found = lattice_condition(part)
            if found is not None:
                points /= found[1]
    return points
