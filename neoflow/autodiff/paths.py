"""Where a tensor is read in an op, and how the op's value depends on each read.

For ``Out[x] = body`` every occurrence of a read ``A[f(v)]`` is found together
with the index variables ``v`` in scope there (the output indices and the axes
of the enclosing reductions), the affine conditions under which the read
happens (``Select`` guards, reduction ``where`` clauses) and the derivative
factor ``dOut[x] / dA[f(v)]`` at that point, built from local partials
(``neoflow.autodiff.symbolic``) along the path from the root to the read.

Where an element-wise op's derivative is a function of its own value, the
factor reads the op's output instead of recomputing it from the inputs
(``_local``), as frameworks save an activation's output for its
backward: ``tanh``'s ``1 - Out^2``, ``sigmoid``'s ``Out * (1 - Out)``,
``exp``'s ``Out``, and a ReLU's ``[Out > 0]``.  The backward then need not
read the activation's input, which leaves that input one reader: the
activation, fused as the epilogue of the conv or matmul producing it.  A
``max``/``min`` against a constant gives a tie to the constant (``relu'(0) =
0``, as in PyTorch and JAX), which is what lets its comparison read the output:
``x > c`` exactly where ``max(x, c) > c``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from neoflow.autodiff.symbolic import partial, simplify
from neoflow.ir.bounds import condition_to_isl
from neoflow.ir.expr import Binary, Const, Expr, Read, Reduce, Select, Unary, map_children, reductions
from neoflow.ir.index import var
from neoflow.ir.op import Op


@dataclass(frozen=True)
class Occurrence:
    """One read of the differentiated tensor.

    ``variables`` are the index variables in scope (output indices first, then
    enclosing reduction axes, outermost first); ``guards`` are affine conditions
    that hold wherever the read happens; ``factor`` is the derivative of the
    op's output with respect to the read (None for 1)."""

    read: Read
    variables: tuple[str, ...]
    guards: tuple[Expr, ...]
    factor: Expr | None


def _times(factor: Expr | None, extra: Expr | None) -> Expr | None:
    if extra is None or extra == Const(1):
        return factor
    return extra if factor is None else Binary("*", factor, extra)


def _is_affine(cond: Expr) -> bool:
    """True when isl can represent ``cond`` exactly (its reads do not matter)."""
    return (
        condition_to_isl(cond, True) is not None
        and condition_to_isl(cond, False) is not None
        and not any(isinstance(n, Read) for n in cond.walk())
    )


def _reduce_partial(node: Reduce, value: Expr) -> Expr | None:
    """d(reduction)/d(one term of it); ``value`` is the reduction's result.

    ReduceMax/ReduceMin route the adjoint to every term equal to the result (all
    tied terms receive it); ReduceMul divides the product by the term, so it
    needs terms that are not zero."""
    if node.kind == "ReduceAdd":
        return None
    if node.kind == "ReduceMul":
        return Binary("/", value, node.body)
    return Select(Binary("==", node.body, value), Const(1), Const(0))


def _replaced(node: Expr, old: Expr, new: Expr) -> Expr:
    """``node`` with every subexpression equal to ``old`` replaced by ``new``."""
    return new if node == old else map_children(node, lambda child: _replaced(child, old, new))


def _against_constant(node: Expr, child: int) -> tuple[str, Expr] | None:
    """For ``max(x, c)``/``min(x, c)`` (either order) and ``child`` the index of
    ``x``: the comparison under which ``x`` is the value (``>`` or ``<``, ties
    to the constant) and the constant ``c``; None for any other node."""
    if not isinstance(node, Binary) or node.op not in ("max", "min"):
        return None
    other = node.b if child == 0 else node.a
    if not isinstance(other, Const) or isinstance(node.a if child == 0 else node.b, Const):
        return None
    return (">" if node.op == "max" else "<"), other


def _local(node: Expr, child: int, output: Read | None) -> Expr | None:
    """The derivative of ``node`` with respect to its ``child``-th child (None
    when identically zero); ``output`` is the op's output where ``node`` is the
    op's whole element-wise body, read wherever it equals a value the
    derivative recomputes (see the module docstring)."""
    clamp = _against_constant(node, child)
    if clamp is not None:
        compare, constant = clamp
        subject = node.children()[child] if output is None else output
        return Select(Binary(compare, subject, constant), Const(1), Const(0))
    local = partial(node, child)
    return local if local is None or output is None else _replaced(local, node, output)


def occurrences(op: Op, tensor: str) -> list[Occurrence]:
    """Every read of ``tensor`` in ``op`` that the output depends on differentiably."""
    top_value = Read(op.name, tuple(var(v) for v in op.indices), op.dtype)
    elementwise = op.scatter is None and not reductions(op.body)  # its output at its indices is its body

    def walk(node: Expr, factor: Expr | None, guards: tuple[Expr, ...], scope: tuple[str, ...]) -> Iterator[Occurrence]:
        if isinstance(node, Read):
            if node.tensor == tensor:
                yield Occurrence(node, scope, guards, None if factor is None else simplify(factor))
            return
        if isinstance(node, Select):
            for branch, cond in ((node.a, node.cond), (node.b, Unary("!", node.cond))):
                if _is_affine(node.cond):
                    yield from walk(branch, factor, (*guards, cond), scope)
                else:
                    yield from walk(branch, _times(factor, Select(cond, Const(1), Const(0))), guards, scope)
            return
        if isinstance(node, Reduce):
            value = top_value if node is op.body else node
            inner_factor = _times(factor, _reduce_partial(node, value))
            inner_guards = guards
            if node.where is not None:
                if _is_affine(node.where):
                    inner_guards = (*guards, node.where)
                else:
                    inner_factor = _times(inner_factor, Select(node.where, Const(1), Const(0)))
            yield from walk(node.body, inner_factor, inner_guards, (*scope, *node.axes))
            return
        for i, child in enumerate(node.children()):
            local = _local(node, i, top_value if node is op.body and elementwise else None)
            if local is not None:
                yield from walk(child, _times(factor, local), guards, scope)

    return list(walk(op.body, None, (), tuple(op.indices)))
