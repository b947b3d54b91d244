"""Partial derivatives of value expressions, computed by sympy.

A value expression is turned into a sympy expression in which tensor reads,
index values, float literals, conditions and nested reductions are opaque
placeholder symbols; ``Select``, ``max``, ``min``, ``sigmoid``, ``abs`` and casts
are sympy functions that know their own derivatives.  ``sympy.diff`` does the
calculus and the result is turned back into a value expression.

Tie rules: ``d max(a, b)/da = [a >= b]`` and ``d max(a, b)/db = [a < b]`` (ties go
to the first argument; likewise for ``min``); ``d abs(x)/dx = sign(x)`` with
``sign(0) = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from neoflow.ir import dtypes as dt
from neoflow.ir.expr import COMPARISONS, Binary, Cast, Const, Expr, Select, Unary, map_children


class _Opaque(sympy.Function):
    """A function sympy must not look into; its derivative is zero."""

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return sympy.Integer(0)


class Sel(sympy.Function):
    """``Select(cond, a, b)``."""

    nargs = 3

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        cond = self.args[0]
        return {1: sympy.Integer(0), 2: Sel(cond, 1, 0), 3: Sel(cond, 0, 1)}[argindex]


class Sigmoid(sympy.Function):
    nargs = 1

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return Sigmoid(self.args[0]) * (1 - Sigmoid(self.args[0]))


class Sign(_Opaque):
    nargs = 1


class VAbs(sympy.Function):
    nargs = 1

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return Sign(self.args[0])


_COMPARE: dict[str, type[sympy.Function]] = {
    op: type(f"Compare{i}", (_Opaque,), {"nargs": 2, "op": op}) for i, op in enumerate(COMPARISONS)
}


def _extremum(name: str, compare: str) -> type[sympy.Function]:
    """``max``/``min`` of two values; the first argument wins ties (``compare`` is ``>=``/``<=``)."""

    def fdiff(self: sympy.Function, argindex: int = 1) -> sympy.Expr:
        first = _COMPARE[compare](*self.args)
        return Sel(first, 1, 0) if argindex == 1 else Sel(first, 0, 1)

    return type(name, (sympy.Function,), {"nargs": 2, "fdiff": fdiff})


VMax = _extremum("VMax", ">=")
VMin = _extremum("VMin", "<=")


def _cast_function(dtype: str) -> type[sympy.Function]:
    def fdiff(self: sympy.Function, argindex: int = 1) -> sympy.Expr:
        return sympy.Integer(1 if dt.is_float(dtype) else 0)

    return type(f"Cast_{dtype}", (sympy.Function,), {"nargs": 1, "fdiff": fdiff, "dtype": dtype})


_CASTS = {dtype: _cast_function(dtype) for dtype in dt.DTYPES}
_UNARY_TO = {
    "erf": sympy.erf,
    "exp": sympy.exp,
    "log": sympy.log,
    "tanh": sympy.tanh,
    "sqrt": sympy.sqrt,
    "sigmoid": Sigmoid,
    "abs": VAbs,
}
_UNARY_FROM = {
    sympy.erf: "erf",
    sympy.exp: "exp",
    sympy.log: "log",
    sympy.tanh: "tanh",
    Sigmoid: "sigmoid",
    VAbs: "abs",
}


class Translator:
    """Converts value expressions to sympy and back, keeping the placeholders."""

    def __init__(self) -> None:
        self.symbols: dict[Expr, sympy.Symbol] = {}
        self.values: dict[sympy.Symbol, Expr] = {}

    def placeholder(self, node: Expr) -> sympy.Symbol:
        """The symbol standing for ``node`` (the same one for equal nodes)."""
        if node not in self.symbols:
            symbol = sympy.Symbol(f"_v{len(self.symbols)}")
            self.symbols[node] = symbol
            self.values[symbol] = node
        return self.symbols[node]

    def to_sympy(self, node: Expr) -> sympy.Expr:
        """``node`` as a sympy expression."""
        if isinstance(node, Const) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return sympy.Integer(node.value)
        if isinstance(node, Unary):
            if node.op == "-":
                return -self.to_sympy(node.x)
            if node.op in _UNARY_TO:
                return _UNARY_TO[node.op](self.to_sympy(node.x))
            if node.op != "!":
                raise TypeError(f"no derivative rule for '{node.op}'")
        if isinstance(node, Binary):
            if node.op in COMPARISONS:
                return _COMPARE[node.op](self.to_sympy(node.a), self.to_sympy(node.b))
            a, b = self.to_sympy(node.a), self.to_sympy(node.b)
            arithmetic = {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                "/": lambda: a / b,
                "pow": lambda: a**b,
                "max": lambda: VMax(a, b),
                "min": lambda: VMin(a, b),
            }
            if node.op in arithmetic:
                return arithmetic[node.op]()
        if isinstance(node, Select):
            return Sel(self.placeholder(node.cond), self.to_sympy(node.a), self.to_sympy(node.b))
        if isinstance(node, Cast):
            return _CASTS[node.to](self.to_sympy(node.x))
        return self.placeholder(node)

    def from_sympy(self, expr: sympy.Expr) -> Expr:
        """A value expression for ``expr``."""
        if expr.is_Symbol:
            return self.values[expr]
        if expr.is_Integer:
            return Const(int(expr))
        if expr.is_Number or expr.is_NumberSymbol or (expr.is_number and not expr.free_symbols):
            return Const(float(expr))
        if expr.is_Add:
            return self._sum(expr)
        if expr.is_Mul or expr.is_Pow:
            return self._product(expr)
        func = expr.func
        args = expr.args
        if func in _UNARY_FROM:
            return Unary(_UNARY_FROM[func], self.from_sympy(args[0]))
        if func is Sel:
            return Select(self.from_sympy(args[0]), self.from_sympy(args[1]), self.from_sympy(args[2]))
        if func is VMax or func is VMin:
            return Binary("max" if func is VMax else "min", self.from_sympy(args[0]), self.from_sympy(args[1]))
        if func is Sign:
            x = self.from_sympy(args[0])
            return Select(Binary(">", x, Const(0)), Const(1), Select(Binary("<", x, Const(0)), Const(-1), Const(0)))
        if hasattr(func, "op"):
            return Binary(func.op, self.from_sympy(args[0]), self.from_sympy(args[1]))
        if hasattr(func, "dtype"):
            return Cast(func.dtype, self.from_sympy(args[0]))
        raise TypeError(f"cannot translate {expr} back")

    def _sum(self, expr: sympy.Add) -> Expr:
        terms = sorted(expr.args, key=lambda t: (t.could_extract_minus_sign(), sympy.default_sort_key(t)))
        out: Expr | None = None
        for term in terms:
            negative = term.could_extract_minus_sign()
            value = self.from_sympy(-term if negative else term)
            if out is None:
                out = Unary("-", value) if negative else value
            else:
                out = Binary("-" if negative else "+", out, value)
        assert out is not None
        return out

    def _product(self, expr: sympy.Expr) -> Expr:
        coeff, rest = expr.as_coeff_Mul()
        if coeff < 0:
            return Unary("-", self.from_sympy(-expr))
        numerator: list[Expr] = [] if coeff == 1 else [self.from_sympy(coeff)]
        denominator: list[Expr] = []
        for factor in sympy.Mul.make_args(rest):
            base, exponent = factor.as_base_exp() if factor.is_Pow else (factor, sympy.Integer(1))
            target = denominator if exponent.is_number and exponent < 0 else numerator
            exponent = -exponent if target is denominator else exponent
            target.append(self._power(base, exponent))
        top = _fold("*", numerator) if numerator else Const(1)
        return Binary("/", top, _fold("*", denominator)) if denominator else top

    def _power(self, base: sympy.Expr, exponent: sympy.Expr) -> Expr:
        value = self.from_sympy(base)
        if exponent == 1:
            return value
        if exponent == sympy.Rational(1, 2):
            return Unary("sqrt", value)
        if exponent.is_Integer and 1 < exponent <= 4:
            return _fold("*", [value] * int(exponent))
        return Binary("pow", value, self.from_sympy(exponent))


def _fold(op: str, items: list[Expr]) -> Expr:
    out = items[0]
    for item in items[1:]:
        out = Binary(op, out, item)
    return out


@dataclass(frozen=True)
class _Leaf(Expr):
    """Stands for one child of the node being differentiated."""

    position: int


def partial(node: Expr, child: int) -> Expr | None:
    """The derivative of ``node`` with respect to its ``child``-th child, as a value
    expression over the node's children; None when it is identically zero."""
    children = node.children()
    leaves = iter(_Leaf(i) for i in range(len(children)))
    translator = Translator()
    local = translator.to_sympy(map_children(node, lambda _: next(leaves)))
    derivative = sympy.diff(local, translator.placeholder(_Leaf(child)))
    if derivative == 0:
        return None
    for i, value in enumerate(children):
        translator.values[translator.placeholder(_Leaf(i))] = value
    return translator.from_sympy(derivative)


def simplify(node: Expr) -> Expr:
    """``node`` after a round trip through sympy (collects like terms, drops ``* 1``)."""
    translator = Translator()
    return translator.from_sympy(translator.to_sympy(node))
