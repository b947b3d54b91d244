"""Index expressions: sympy integer expressions over index variables.

Index expressions use ``+ - *``, floor division and modulo by constants (and
products of variables, which make them non-affine).  A read of another tensor
inside an index (``X[idx[i]]``) is a sympy function application ``idx(i)``:
such an index is data dependent.  This module builds them, converts affine
ones to isl syntax, evaluates them on numpy index grids and prints them in the
text language.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import cache, lru_cache

import numpy as np
import sympy
from sympy.core.function import AppliedUndef

IndexExpr = sympy.Expr


@cache
def var(name: str) -> sympy.Symbol:
    """The index variable called ``name`` (an integer sympy symbol)."""
    return sympy.Symbol(name, integer=True)


def index_vars(rank: int, prefix: str = "i") -> list[str]:
    """``i0, i1, ...``: index variable names for a tensor of ``rank`` dimensions."""
    return [f"{prefix}{d}" for d in range(rank)]


def flat_offset(indices: Sequence[IndexExpr], shape: Sequence[int]) -> sympy.Expr:
    """The row-major element offset of ``indices`` into a tensor of ``shape`` (expanded)."""
    terms = (expr * math.prod(shape[d + 1 :]) for d, expr in enumerate(indices))
    return sympy.expand(sum(terms, sympy.Integer(0)))


def const(value: int) -> sympy.Integer:
    """An integer constant index expression."""
    return sympy.Integer(value)


def floordiv(a: IndexExpr, b: IndexExpr) -> IndexExpr:
    """``a // b`` (floor division; ``b`` must be a non-zero integer constant)."""
    return sympy.floor(a / b)


def mod(a: IndexExpr, b: IndexExpr) -> IndexExpr:
    """``a % b`` with the sign of ``b`` (Python semantics)."""
    return sympy.Mod(a, b)


def tensor_read(name: str, args: tuple[IndexExpr, ...]) -> IndexExpr:
    """A data-dependent index: the value of tensor ``name`` at ``args``."""
    return sympy.Function(name)(*args)


def variables(expr: IndexExpr) -> set[str]:
    """Names of the index variables in ``expr`` (including inside tensor reads)."""
    return {s.name for s in expr.free_symbols}


@lru_cache(maxsize=65536)
def linear_terms(expr: IndexExpr) -> dict[str, sympy.Expr] | None:
    """Each variable's coefficient in ``expr`` where every term is a number or a number times
    one variable; None otherwise."""
    terms: dict[str, sympy.Expr] = {}
    for term in sympy.Add.make_args(expr):
        c, rest = term.as_coeff_Mul()
        if rest.is_Symbol:
            terms[rest.name] = terms.get(rest.name, sympy.Integer(0)) + c
        elif rest.free_symbols:
            return None
    return terms


def coefficient(expr: IndexExpr, name: str) -> sympy.Expr:
    """``expr.coeff(var(name))``, answered from a table of ``expr``'s terms where it is linear
    (the cost models ask for the coefficients of one offset many times; sympy's ``coeff``
    walks the expression each time)."""
    terms = linear_terms(expr)
    if terms is None:
        return expr.coeff(var(name))
    return terms.get(name, sympy.Integer(0))


def data_reads(expr: IndexExpr) -> list[AppliedUndef]:
    """The tensor reads nested in ``expr`` (data-dependent indices)."""
    return sorted(expr.atoms(AppliedUndef), key=sympy.default_sort_key)


def denominator(expr: IndexExpr) -> int:
    """The least common denominator of the rational coefficients of ``expr``."""
    return math.lcm(*[int(t.as_coeff_Mul()[0].q) for t in sympy.Add.make_args(sympy.expand(expr))])


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base2``, ``base3``... whichever is not in ``taken`` (it is added)."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}{n}"
    taken.add(name)
    return name


def to_isl(expr: IndexExpr, prefix: str = "") -> str | None:
    """isl syntax for a quasi-affine expression, or None if it is not quasi-affine.
    Variable names get ``prefix`` (to keep clear of isl's keywords)."""
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return prefix + expr.name
    if isinstance(expr, sympy.floor):
        den = denominator(expr.args[0])
        num = to_isl(sympy.expand(expr.args[0] * den), prefix)
        return None if num is None else f"floor(({num})/{den})"
    if isinstance(expr, sympy.Mod):
        a, m = expr.args
        inner = to_isl(a, prefix)
        if inner is None or not m.is_Integer:
            return None
        return f"(({inner}) mod {int(m)})"
    if expr.is_Add:
        parts = [to_isl(a, prefix) for a in expr.args]
        return None if None in parts else "(" + " + ".join(parts) + ")"
    if expr.is_Mul:
        c, rest = expr.as_coeff_Mul()
        if not c.is_Integer or rest.is_Mul:
            return None  # a fraction, or a product of two non-constant factors
        inner = to_isl(rest, prefix)
        return None if inner is None else f"({int(c)}*{inner})"
    return None


def is_quasi_affine(expr: IndexExpr) -> bool:
    """True if isl can represent ``expr`` (affine up to floor/mod by constants)."""
    return to_isl(expr) is not None


ReadFn = Callable[[str, tuple[np.ndarray, ...]], np.ndarray]


def evaluate(expr: IndexExpr, env: Mapping[str, np.ndarray], read: ReadFn | None = None) -> np.ndarray | int:
    """Evaluate ``expr`` with numpy: ``env`` maps variable names to int64 arrays
    that broadcast together; ``read(tensor, indices)`` serves data-dependent
    reads.  Returns an int64 array (or a Python int for constants)."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return env[expr.name]
    if isinstance(expr, sympy.floor):
        arg = expr.args[0]
        den = denominator(arg)
        return np.floor_divide(evaluate(sympy.expand(arg * den), env, read), int(den))
    if isinstance(expr, sympy.Mod):
        return np.mod(evaluate(expr.args[0], env, read), evaluate(expr.args[1], env, read))
    if expr.is_Add:
        total: np.ndarray | int = 0
        for a in expr.args:
            total = total + evaluate(a, env, read)
        return total
    if expr.is_Mul:
        product: np.ndarray | int = 1
        for a in expr.args:
            if not a.is_Integer and a.is_Rational:
                raise ValueError(f"fractional index expression {expr}")
            product = product * evaluate(a, env, read)
        return product
    if is_power(expr):
        return evaluate(expr.base, env, read) ** int(expr.exp)
    if isinstance(expr, AppliedUndef):
        if read is None:
            raise ValueError(f"data-dependent index {expr} needs a reader")
        args = tuple(np.asarray(evaluate(a, env, read), dtype=np.int64) for a in expr.args)
        return read(expr.func.__name__, args)
    raise ValueError(f"unsupported index expression {expr}")


# -- printing -----------------------------------------------------------------

_PREC_ADD, _PREC_MUL, _PREC_ATOM = 1, 2, 3


def _terms_in_order(expr: sympy.Add) -> list[IndexExpr]:
    terms = list(expr.as_ordered_terms())
    positive = [t for t in terms if not t.could_extract_minus_sign() and not t.is_Number]
    negative = [t for t in terms if t.could_extract_minus_sign() and not t.is_Number]
    numbers = [t for t in terms if t.is_Number]
    return positive + negative + numbers


def _print(expr: IndexExpr) -> tuple[str, int]:
    if expr.is_Integer:
        value = int(expr)
        return str(value), _PREC_ATOM if value >= 0 else _PREC_ADD
    if expr.is_Symbol:
        return expr.name, _PREC_ATOM
    if isinstance(expr, AppliedUndef):
        return f"{expr.func.__name__}[{', '.join(to_text(a) for a in expr.args)}]", _PREC_ATOM
    if isinstance(expr, sympy.floor):
        arg = expr.args[0]
        den = denominator(arg)
        num = sympy.expand(arg * den)
        return f"{_wrap(num, _PREC_MUL)}//{den}", _PREC_MUL
    if isinstance(expr, sympy.Mod):
        return f"{_wrap(expr.args[0], _PREC_MUL)}%{_wrap(expr.args[1], _PREC_ATOM)}", _PREC_MUL
    if expr.is_Add:
        out = ""
        for i, term in enumerate(_terms_in_order(expr)):
            if term.could_extract_minus_sign():
                out += (" - " if i else "-") + _wrap(-term, _PREC_MUL if i else _PREC_ATOM)
            else:
                out += (" + " if i else "") + _wrap(term, _PREC_ADD + 1 if i else _PREC_ADD)
        return out, _PREC_ADD
    if expr.is_Mul:
        c, rest = expr.as_coeff_Mul()
        if c == -1:
            return "-" + _wrap(rest, _PREC_ATOM), _PREC_ADD
        factors = [_wrap(f, _PREC_MUL + 1) for f in sympy.Mul.make_args(rest)]
        if c != 1:
            factors.insert(0, _wrap(c, _PREC_ATOM))
        return "*".join(factors), _PREC_MUL
    if is_power(expr):
        return "*".join([_wrap(expr.base, _PREC_MUL + 1)] * int(expr.exp)), _PREC_MUL
    raise ValueError(f"cannot print index expression {expr}")


def is_power(expr: IndexExpr) -> bool:
    """Whether ``expr`` is an index expression to a positive integer power: sympy writes
    some products that way (``Mod(3*(i % 3), 2)`` becomes ``Mod((i % 3)**2, 2)``)."""
    return bool(expr.is_Pow and expr.exp.is_Integer and expr.exp > 0)


def _wrap(expr: IndexExpr, min_prec: int) -> str:
    text, prec = _print(expr)
    return text if prec >= min_prec else f"({text})"


def to_text(expr: IndexExpr) -> str:
    """Print an index expression in the text language (``//`` for floor division)."""
    return _print(expr)[0]
