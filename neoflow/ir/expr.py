"""Value expressions: what an op computes at each point of its index space.

Nodes are immutable and compare by value.  Index arithmetic lives in sympy
(``neoflow.ir.index``); a value expression uses it in tensor reads
(``Read.indices``) and as a value (``Index``, e.g. the ``h`` in ``h > 2``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import sympy

from neoflow.ir import dtypes, index
from neoflow.ir.dtypes import WEAK_FLOAT, WEAK_INT

UNARY_FUNCTIONS = ("exp", "log", "sqrt", "tanh", "sigmoid", "abs", "erf")
BINARY_FUNCTIONS = ("pow", "max", "min")
ARITHMETIC = ("+", "-", "*", "/", "//", "%")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
LOGICAL = ("&&", "||")
REDUCTIONS = ("ReduceAdd", "ReduceMax", "ReduceMin", "ReduceMul")


class Expr:
    """Base class of value expressions."""

    def children(self) -> tuple[Expr, ...]:
        """The direct sub-expressions."""
        return ()

    @cached_property
    def dtype(self) -> str:
        """The element type; may be weak (see ``neoflow.ir.dtypes``)."""
        raise NotImplementedError(type(self).__name__)

    def walk(self) -> Iterator[Expr]:
        """This node and all nodes below it, parents first."""
        yield self
        for child in self.children():
            yield from child.walk()

    def reads(self) -> list[Read]:
        """Every tensor read in the expression, in order of appearance."""
        return [node for node in self.walk() if isinstance(node, Read)]


@dataclass(frozen=True)
class Const(Expr):
    """A literal: ``2``, ``0.5``, ``true``, ``inf``.  Its dtype is weak."""

    value: int | float | bool

    @cached_property
    def dtype(self) -> str:
        if isinstance(self.value, bool):
            return "bool"
        return WEAK_INT if isinstance(self.value, int) else WEAK_FLOAT


@dataclass(frozen=True)
class Index(Expr):
    """An index expression used as a value (``h`` in ``h > 2``)."""

    expr: sympy.Expr

    @cached_property
    def dtype(self) -> str:
        return WEAK_INT


@dataclass(frozen=True)
class Read(Expr):
    """``tensor[indices]``: one element of a tensor of the given dtype."""

    tensor: str
    indices: tuple[sympy.Expr, ...]
    tensor_dtype: str = "float32"

    @cached_property
    def dtype(self) -> str:
        return self.tensor_dtype


@dataclass(frozen=True)
class Unary(Expr):
    """``-x``, ``!x`` or a one-argument function (``exp``, ``log`` ...)."""

    op: str
    x: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)

    @cached_property
    def dtype(self) -> str:
        if self.op == "!":
            return "bool"
        if self.op in ("-", "abs"):
            return self.x.dtype
        return dtypes.to_float(self.x.dtype)


@dataclass(frozen=True)
class Binary(Expr):
    """Arithmetic, comparison, logical and two-argument functions."""

    op: str
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.a, self.b)

    @cached_property
    def operand_dtype(self) -> str:
        """The dtype both operands are converted to before the operation."""
        common = dtypes.promote(self.a.dtype, self.b.dtype)
        if self.op in ("/", "pow"):
            return dtypes.to_float(common)
        return common

    @cached_property
    def dtype(self) -> str:
        if self.op in COMPARISONS or self.op in LOGICAL:
            return "bool"
        return self.operand_dtype


@dataclass(frozen=True)
class Select(Expr):
    """``Select(cond, a, b)``: ``a`` where ``cond`` holds, else ``b``.

    Reads in the branch not taken are never performed, so they may be out of
    bounds there (that is how padding and concatenation are written).
    """

    cond: Expr
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.a, self.b)

    @cached_property
    def dtype(self) -> str:
        return dtypes.promote(self.a.dtype, self.b.dtype)


@dataclass(frozen=True)
class Cast(Expr):
    """``float16(x)`` and friends: convert to ``to``."""

    to: str
    x: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)

    @cached_property
    def dtype(self) -> str:
        return self.to


@dataclass(frozen=True)
class Reduce(Expr):
    """``ReduceAdd({r, s | cond}, body)``: combine ``body`` over the named axes.

    ``extents[i]`` is the extent written in the text for ``axes[i]``
    (``{r: 3}``) or None when it is inferred from the tensors ``axes[i]``
    indexes.  ``kind`` is one of ``REDUCTIONS``.  ``where``, when given,
    restricts the reduction to the points where it holds (an exact iteration
    domain: strides, parity, triangular bounds); reads in ``body`` happen only
    there.
    """

    kind: str
    axes: tuple[str, ...]
    extents: tuple[int | None, ...]
    body: Expr
    where: Expr | None = None

    def children(self) -> tuple[Expr, ...]:
        return (self.body,) if self.where is None else (self.where, self.body)

    @cached_property
    def dtype(self) -> str:
        return self.body.dtype


def map_children(node: Expr, fn: Callable[[Expr], Expr]) -> Expr:
    """A copy of ``node`` with ``fn`` applied to each direct child."""
    if isinstance(node, Unary):
        return Unary(node.op, fn(node.x))
    if isinstance(node, Binary):
        return Binary(node.op, fn(node.a), fn(node.b))
    if isinstance(node, Select):
        return Select(fn(node.cond), fn(node.a), fn(node.b))
    if isinstance(node, Cast):
        return Cast(node.to, fn(node.x))
    if isinstance(node, Reduce):
        return Reduce(node.kind, node.axes, node.extents, fn(node.body), None if node.where is None else fn(node.where))
    return node


def reductions(expr: Expr) -> list[Reduce]:
    """Every reduction in ``expr``, outermost first."""
    return [node for node in expr.walk() if isinstance(node, Reduce)]


def map_indices(node: Expr, fn: Callable[[sympy.Expr], sympy.Expr]) -> Expr:
    """A copy of ``node`` with ``fn`` applied to every index expression in it
    (tensor read indices and index values).  Index values that become integer
    constants turn into ``Const``."""
    if isinstance(node, Index):
        expr = fn(node.expr)
        return Const(int(expr)) if expr.is_Integer else Index(expr)
    if isinstance(node, Read):
        return Read(node.tensor, tuple(fn(i) for i in node.indices), node.tensor_dtype)
    return map_children(node, lambda child: map_indices(child, fn))


def conjuncts(cond: Expr) -> list[Expr]:
    """``a && b && c`` as ``[a, b, c]`` (any other condition as ``[cond]``)."""
    if isinstance(cond, Binary) and cond.op == "&&":
        return [*conjuncts(cond.a), *conjuncts(cond.b)]
    return [cond]


def bound_variables(node: Expr) -> set[str]:
    """Names of all reduction axes in ``node``."""
    return {axis for r in reductions(node) for axis in r.axes}


def index_variables(node: Expr) -> set[str]:
    """Index variables ``node`` uses (in index values and read indices)."""
    names: set[str] = set()
    for item in node.walk():
        if isinstance(item, Index):
            names |= index.variables(item.expr)
        elif isinstance(item, Read):
            for expr in item.indices:
                names |= index.variables(expr)
    return names
