"""Entry points from text: ``parse_op`` and ``parse_graph``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from neoflow.errors import ParseError, ShapeError
from neoflow.ir import dtypes as dt
from neoflow.ir.build import build_op, build_ops
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op, Tensor
from neoflow.ir.syntax import Assign, parse

Shapes = Mapping[str, Sequence[int]]


def parse_graph(
    text: str,
    shapes: Shapes | None = None,
    dtypes: Mapping[str, str] | None = None,
    dtype: str = dt.DEFAULT_FLOAT,
    outputs: Sequence[str] | None = None,
) -> Graph:
    """Parse several statements into a ``Graph``.

    ``shapes``/``dtypes`` give tensors by name (inputs; outputs to pin them);
    ``dtype`` is the dtype of tensors not named in ``dtypes``.  Outputs default
    to the tensors no op reads."""
    statements = parse(text)
    if not any(isinstance(s, Assign) for s in statements):
        raise ParseError("no statement defines a tensor")
    ops = build_ops(statements, shapes or {}, dtypes or {}, dt.check_dtype(dtype))
    return Graph.from_ops(ops, list(outputs) if outputs is not None else None)


def parse_op(
    text: str,
    shapes: Shapes | None = None,
    out_shape: Sequence[int] | None = None,
    dtype: str = dt.DEFAULT_FLOAT,
    dtypes: Mapping[str, str] | None = None,
) -> Op:
    """Parse one statement (declarations may precede it) into an ``Op``.

    ``out_shape`` pins the output shape (as does giving the output's name in
    ``shapes``).  ``dtype`` is the dtype of every input not named in ``dtypes``
    and of float results; the output's dtype follows from the expression
    (``X[i] > 0`` is bool) unless ``dtypes`` names it."""
    statements = parse(text)
    assigns = [s for s in statements if isinstance(s, Assign)]
    if len(assigns) != 1:
        raise ParseError(
            f"expected one statement defining a tensor, found {len(assigns)} (use neoflow.graph for several)"
        )
    if shapes is not None and not isinstance(shapes, Mapping):
        raise ShapeError("shapes are a mapping from tensor names (shapes={'X': (4, 5)})")
    shapes = dict(shapes or {})
    name = assigns[0].target.name
    if out_shape is not None:
        if name in shapes and tuple(shapes[name]) != tuple(out_shape):
            raise ParseError(f"out_shape {list(out_shape)} disagrees with shapes['{name}'] = {list(shapes[name])}")
        shapes[name] = out_shape
    return build_ops(statements, shapes, dtypes or {}, dt.check_dtype(dtype))[0]


def build_statement(
    text: str,
    tensors: Mapping[str, Tensor],
    out_shape: Sequence[int] | None = None,
    dtype: str | None = None,
) -> Op:
    """Build the one statement in ``text`` as an op reading the given ``tensors``
    (by name); ``out_shape``/``dtype`` pin the output, else they are inferred."""
    statements = [s for s in parse(text) if isinstance(s, Assign)]
    if len(statements) != 1:
        raise ParseError(f"expected one statement, found {len(statements)}")
    return build_op(statements[0], tensors, None if out_shape is None else tuple(out_shape), dtype)
