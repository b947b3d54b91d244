"""Invert a read's index map over the integers.

For a read ``A[f(v)]`` with ``v`` the index variables in scope, find every
integer ``v`` with ``f(v) = z``:

1. Quasi-affine pieces ``floor(e/c)`` and ``e mod c`` become fresh variables
   ``Q`` and ``R`` with ``e = c*Q + R, 0 <= R < c``; when ``e`` is a single
   variable it is replaced by ``c*Q + R`` everywhere, otherwise the equation is
   added to the system.
2. The affine system is brought to reduced row echelon form with exact rational
   arithmetic (sympy), choosing pivots in this order of preference: the op's
   output indices, quotients, reduction axes, remainders.  So the output
   indices are solved for and the reduction axes stay free, as in the seed's
   ``p = (z3 - r)/2``.
3. Each pivot is an affine function of ``z`` and the free variables with
   rational coefficients; where a denominator ``L`` remains, the pivot is
   ``floor(N/L)`` under the lattice condition ``N mod L == 0``.  Rows without a
   pivot give consistency conditions on ``z`` (a diagonal read ``X[i, i]``).
4. Where such a condition fixes a free variable ``u`` — ``N = rest +- u`` with
   ``u``'s extent ``L`` and ``rest`` free of free variables — exactly one ``u``
   meets it: ``u`` is solved (``(-+rest) mod L``) instead of enumerated under the
   condition.  A grouped convolution's input adjoint then sums over the group's
   kernels alone, not over every channel of the group keeping one in ``L``.

The free variables become the adjoint's new reduction axes; every integer point
that satisfies the conditions corresponds to exactly one forward point, so an
adjoint enumerating them wastes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sympy

from neoflow.ir import index
from neoflow.ir.expr import Binary, Const, Expr, Index, Read, map_indices


class NotAffine(Exception):
    """The index map is not affine even after the quasi-affine step."""


@dataclass
class Solution:
    """The inverse of one read's index map.

    ``substitution`` maps every forward variable in scope (and every quotient or
    remainder variable) to an index expression in the ``z`` symbols and the
    ``free`` variables; ``replacements`` are the quasi-affine pieces to replace
    (in order) before substituting; ``conditions`` must hold for a ``(z, free)``
    point to correspond to a forward point (together with the forward box,
    which the caller adds); ``extents`` are the known extents of new variables.
    """

    z: tuple[sympy.Symbol, ...]
    free: tuple[str, ...]
    substitution: dict[sympy.Symbol, sympy.Expr]
    replacements: list[dict[sympy.Expr, sympy.Expr]]
    conditions: list[Expr]
    extents: dict[str, int] = field(default_factory=dict)
    new_variables: list[str] = field(default_factory=list)

    def apply(self, expr: sympy.Expr) -> sympy.Expr:
        """Rewrite a forward index expression in terms of ``z`` and the free variables."""
        for step in self.replacements:
            expr = expr.xreplace(step)
        return expr.xreplace(self.substitution)


def _quasi_atoms(exprs: Sequence[sympy.Expr]) -> list[sympy.Expr]:
    atoms = set().union(*(e.atoms(sympy.floor, sympy.Mod) for e in exprs)) if exprs else set()
    innermost = [a for a in atoms if not a.args[0].atoms(sympy.floor, sympy.Mod)]
    return sorted(innermost, key=sympy.default_sort_key)


def _split(atom: sympy.Expr) -> tuple[sympy.Expr, int]:
    """``(e, c)`` for ``floor(e/c)`` or ``e mod c``, with ``e`` integral."""
    if isinstance(atom, sympy.Mod):
        return atom.args[0], int(atom.args[1])
    den = index.denominator(atom.args[0])
    return sympy.expand(atom.args[0] * den), den


def solve(
    read: Read,
    scope: Sequence[str],
    outputs: Sequence[str],
    extents: Mapping[str, int],
    taken: set[str],
) -> Solution:
    """Invert ``read``'s index map over the variables ``scope`` (``outputs`` are the
    op's output indices among them; ``extents`` their extents).  ``taken`` holds
    names new variables must avoid (it is updated).  Raises ``NotAffine``."""
    indices = list(read.indices)
    if any(index.data_reads(i) for i in indices):
        raise NotAffine("its index depends on another tensor's values")
    symbols = {name: index.var(name) for name in scope}
    replacements: list[dict[sympy.Expr, sympy.Expr]] = []
    eliminated: dict[sympy.Symbol, sympy.Expr] = {}
    quotients: list[sympy.Symbol] = []
    remainders: list[sympy.Symbol] = []
    new_extents: dict[str, int] = {}
    equations: list[sympy.Expr] = []
    while atoms := _quasi_atoms(indices + equations):
        e, c = _split(atoms[0])
        if c <= 0:
            raise NotAffine(f"division by {c}")
        base = e.name if e.is_Symbol else f"e{len(quotients) + 1}"
        q = index.var(index.fresh_name(f"{base}_div{c}", taken))
        r = index.var(index.fresh_name(f"{base}_mod{c}", taken))
        quotients.append(q)
        remainders.append(r)
        new_extents[r.name] = c
        step: dict[sympy.Expr, sympy.Expr] = {sympy.floor(e / c): q, sympy.Mod(e, c): r}
        if e.is_Symbol and e.name in symbols and e not in eliminated:
            eliminated[e] = c * q + r
            step[e] = c * q + r
            new_extents[q.name] = -(-extents[e.name] // c)
        else:
            equations.append(e.xreplace(step) - c * q - r)
        replacements.append(step)
        indices = [i.xreplace(step) for i in indices]
        equations = [eq.xreplace(step) for eq in equations]

    preference: list[sympy.Symbol] = []
    for name in outputs:
        s = symbols[name]
        preference.append(next(q for q in quotients if eliminated.get(s, 0).has(q)) if s in eliminated else s)
    preference += [q for q in quotients if q not in preference]
    preference += [symbols[n] for n in scope if n not in outputs and symbols[n] not in eliminated]
    preference += remainders
    z = tuple(sympy.Symbol(f"_z{d}", integer=True) for d in range(len(indices)))

    rows: list[list[sympy.Rational]] = []
    rhs: list[sympy.Expr] = []
    for expr, target in [*zip(indices, z, strict=True), *((eq, sympy.Integer(0)) for eq in equations)]:
        coeffs = _affine_coefficients(expr, preference)
        rows.append([coeffs.get(u, sympy.Integer(0)) for u in preference])
        rhs.append(target - coeffs.get(1, sympy.Integer(0)))
    n = len(preference)
    matrix = sympy.Matrix(rows) if rows else sympy.zeros(0, n)
    reduced, pivots = matrix.row_join(sympy.eye(len(rows))).rref()
    transformed = reduced[:, n:] * sympy.Matrix(rhs) if rows else sympy.Matrix([])
    pivot_of_row = {row: col for row, col in enumerate(pivots)}
    pivot_columns = {col for col in pivots if col < n}
    free = [u for j, u in enumerate(preference) if j not in pivot_columns]

    substitution: dict[sympy.Symbol, sympy.Expr] = {u: u for u in free}
    conditions: list[Expr] = []
    known = {**extents, **new_extents}
    determined: dict[sympy.Symbol, sympy.Expr] = {}
    for row in range(len(rows)):
        col = pivot_of_row.get(row)
        value = sympy.expand(transformed[row])
        if col is None or col >= n:
            if value != 0:
                scale = index.denominator(value)
                conditions.append(Binary("==", Index(sympy.expand(value * scale)), Const(0)))
            continue
        value = sympy.expand(value - sum(reduced[row, j] * preference[j] for j in range(n) if j not in pivot_columns))
        denominator = index.denominator(value)
        if denominator > 1:
            numerator = sympy.expand(value * denominator)
            solved = _determined(numerator, denominator, free, known) if not determined else None
            if solved is not None:
                u, u_value, value = solved
                determined[u] = u_value
            else:
                conditions.append(Binary("==", Index(index.mod(numerator, denominator)), Const(0)))
                value = index.floordiv(numerator, denominator)
        substitution[preference[col]] = value
    if determined:  # a free variable the lattice condition fixes is no reduction axis: its value, everywhere
        substitution = {k: sympy.expand(v.xreplace(determined)) for k, v in substitution.items()}
        substitution.update(determined)
        conditions = [map_indices(c, lambda e: e.xreplace(determined)) for c in conditions]
        free = [u for u in free if u not in determined]
    for s, expr in eliminated.items():
        substitution[s] = sympy.expand(expr.xreplace(substitution))
    return Solution(
        z=z,
        free=tuple(u.name for u in free),
        substitution=substitution,
        replacements=replacements,
        conditions=conditions,
        extents=new_extents,
        new_variables=[s.name for s in quotients + remainders],
    )


def _determined(
    numerator: sympy.Expr, modulus: int, free: Sequence[sympy.Symbol], extents: Mapping[str, int]
) -> tuple[sympy.Symbol, sympy.Expr, sympy.Expr] | None:
    """Where the lattice condition ``numerator mod modulus == 0`` fixes a free variable ``u`` (its
    coefficient +-1, its extent ``modulus``, the rest of ``numerator`` free of every free variable:
    one value of ``u`` in its range meets it, a grouped convolution's channel within its group),
    ``(u, u's value, numerator / modulus)`` with ``u``'s value put in; else None (the condition
    stays and ``u`` is enumerated)."""
    for u in free:
        sign = numerator.coeff(u)
        if sign not in (1, -1) or extents.get(u.name) != modulus:
            continue
        rest = sympy.expand(numerator - sign * u)
        if rest.free_symbols & set(free):
            continue
        value = index.mod(-sign * rest, modulus)  # sign * u = -rest (mod modulus), 0 <= u < modulus
        quotient = index.floordiv(rest, modulus) if sign == -1 else -index.floordiv(-rest, modulus)
        return u, value, quotient
    return None


def _affine_coefficients(expr: sympy.Expr, unknowns: Sequence[sympy.Symbol]) -> dict:
    """Integer coefficients of an affine expression (key 1: the constant)."""
    coeffs: dict = {}
    allowed = set(unknowns)
    for term in sympy.Add.make_args(sympy.expand(expr)):
        c, rest = term.as_coeff_Mul()
        if not c.is_Integer:
            raise NotAffine(f"coefficient {c} in {expr}")
        if rest == 1:
            coeffs[1] = coeffs.get(1, 0) + c
        elif rest in allowed:
            coeffs[rest] = coeffs.get(rest, 0) + c
        else:
            raise NotAffine(f"'{index.to_text(term)}' is not affine")
    return coeffs
