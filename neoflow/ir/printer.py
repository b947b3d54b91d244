"""Print ops and graphs back in the text language; ``parse(print(op)) == op``."""

from __future__ import annotations

import math

from neoflow.ir import index
from neoflow.ir.expr import (
    BINARY_FUNCTIONS,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Read,
    Reduce,
    Select,
    Unary,
)
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op, Tensor

_LEVEL = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
}
_UNARY, _ATOM = 7, 8


def _const(value: int | float | bool) -> tuple[str, int]:
    if isinstance(value, bool):
        return ("true" if value else "false"), _ATOM
    if isinstance(value, float) and math.isnan(value):
        return "nan", _ATOM
    if isinstance(value, float) and math.isinf(value):
        return ("inf" if value > 0 else "-inf"), _ATOM if value > 0 else _UNARY
    text = repr(value)
    return text, _UNARY if text.startswith("-") else _ATOM


def _print(node: Expr) -> tuple[str, int]:
    if isinstance(node, Const):
        return _const(node.value)
    if isinstance(node, Index):
        atomic = node.expr.is_Symbol or (node.expr.is_Integer and node.expr >= 0)
        return index.to_text(node.expr), _ATOM if atomic else _UNARY - 2
    if isinstance(node, Read):
        return f"{node.tensor}[{', '.join(index.to_text(i) for i in node.indices)}]", _ATOM
    if isinstance(node, Unary):
        if node.op in ("-", "!"):
            return node.op + _wrap(node.x, _UNARY), _UNARY
        return f"{node.op}({to_text(node.x)})", _ATOM
    if isinstance(node, Binary):
        if node.op in BINARY_FUNCTIONS:
            return f"{node.op}({to_text(node.a)}, {to_text(node.b)})", _ATOM
        level = _LEVEL[node.op]
        return f"{_wrap(node.a, level)} {node.op} {_wrap(node.b, level + 1)}", level
    if isinstance(node, Select):
        return f"Select({to_text(node.cond)}, {to_text(node.a)}, {to_text(node.b)})", _ATOM
    if isinstance(node, Cast):
        return f"{node.to}({to_text(node.x)})", _ATOM
    if isinstance(node, Reduce):
        axes = ", ".join(a if e is None else f"{a}: {e}" for a, e in zip(node.axes, node.extents, strict=True))
        where = "" if node.where is None else f" | {to_text(node.where)}"
        return f"{node.kind}({{{axes}{where}}}, {to_text(node.body)})", _ATOM
    raise TypeError(f"cannot print {type(node).__name__}")


def _wrap(node: Expr, level: int) -> str:
    text, own = _print(node)
    return text if own >= level else f"({text})"


def to_text(node: Expr) -> str:
    """A value expression in the text language."""
    return _print(node)[0]


def print_op(op: Op) -> str:
    """One statement: ``Out[i, j] = <body>`` (``Out[f(i)] += <body>`` for a scatter)."""
    if op.scatter is not None:
        return f"{op.name}[{', '.join(index.to_text(i) for i in op.scatter)}] += {to_text(op.body)}"
    return f"{op.name}[{', '.join(op.indices)}] = {to_text(op.body)}"


def print_declaration(tensor: Tensor) -> str:
    """``A = tensor([1, 3, 224, 224])`` (with the dtype unless float32)."""
    dtype = "" if tensor.dtype == "float32" else f", {tensor.dtype}"
    return f"{tensor.name} = tensor([{', '.join(map(str, tensor.shape))}]{dtype})"


def print_graph(graph: Graph) -> str:
    """Declarations of every tensor, then the ops in topological order."""
    lines = [print_declaration(t) for t in graph.inputs]
    lines += [print_declaration(op.output) for op in graph.ops]
    lines += [print_op(op) for op in graph.ops]
    return "\n".join(lines)
