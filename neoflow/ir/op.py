"""Tensors and ops: one output tensor defined by an expression over its index variables."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import sympy
from sympy.core.function import AppliedUndef

from neoflow.errors import ShapeError
from neoflow.ir.expr import Expr, Index, Read, Reduce, map_children, map_indices, reductions


@dataclass(frozen=True)
class Tensor:
    """A named dense tensor with a shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.name}{list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class Op:
    """``output[indices] = body``, or with ``scatter`` set, ``output[scatter] += body``.

    ``inputs`` are the tensors ``body`` reads, in order of first appearance;
    ``ranges`` gives the extent of every index variable (output indices first,
    then reduction axes in the order the reductions list them); each variable
    runs over ``[0, extent)``.  ``range_sources`` says where each extent came
    from and ``info`` carries what produced the op (an autodiff ``AdjointInfo``,
    for instance); neither is part of equality.  A scatter op (``scatter`` is the
    tuple of target index expressions) starts from zeros and adds ``body`` at
    ``scatter(v)`` for every point ``v`` of its ``indices``; it is what autodiff
    falls back to where an index map is not affine.
    """

    output: Tensor
    indices: tuple[str, ...]
    body: Expr
    inputs: tuple[Tensor, ...]
    ranges: tuple[tuple[str, int], ...]
    range_sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    info: object = field(default=None, compare=False, repr=False)
    scatter: tuple[sympy.Expr, ...] | None = None

    @property
    def name(self) -> str:
        """The op's name: the name of the tensor it defines."""
        return self.output.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the output tensor."""
        return self.output.shape

    @property
    def dtype(self) -> str:
        """Dtype of the output tensor."""
        return self.output.dtype

    @property
    def extent(self) -> dict[str, int]:
        """Extent of every index variable, by name."""
        return dict(self.ranges)

    @property
    def reductions(self) -> list[Reduce]:
        """The reductions in the body, outermost first."""
        return reductions(self.body)

    @property
    def reduce_axes(self) -> tuple[str, ...]:
        """All reduction axes, in order (sibling reductions may share a name)."""
        return tuple(dict.fromkeys(axis for r in self.reductions for axis in r.axes))

    @cached_property
    def input_names(self) -> tuple[str, ...]:
        """Names of the tensors the op reads (kept: fusion planning asks millions of times)."""
        return tuple(t.name for t in self.inputs)

    def input(self, name: str) -> Tensor:
        """The input tensor called ``name``."""
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        raise KeyError(name)

    def __str__(self) -> str:
        from neoflow.ir.printer import print_op

        return print_op(self)


def given_shape(shape: object, name: str) -> tuple[int, ...]:
    """A shape a caller gave for tensor ``name`` (``shapes=`` of ``op``, ``graph``, ``compile``): a
    sequence of non-negative integers (ONNX allows empty tensors), or a ``ShapeError`` saying what is
    wrong with it."""
    if isinstance(shape, str | bytes) or not hasattr(shape, "__iter__"):
        raise ShapeError(f"the shape given for '{name}' must be a sequence of integers, got {shape!r}")
    dims = list(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 0:
            raise ShapeError(
                f"the shape given for '{name}' has dimension {dim!r}; dimensions are non-negative integers"
            )
    return tuple(int(d) for d in dims)


def positional_names(op: Op) -> Op:
    """``op`` with its tensors named by position (its inputs ``_0``, ``_1``, ... in order, its output
    ``_out``): two ops that compute alike, each from tensors of its own, come out equal (what a
    schedule of the op depends on, asked of many copies of one layer, can then be worked out once)."""
    names = {tensor.name: f"_{k}" for k, tensor in enumerate(op.inputs)}
    names.setdefault(op.name, "_out")
    return rename_tensors(op, names)


def positional_variables(op: Op) -> Op:
    """``op`` with its index variables named by position (its output indices ``_i0``, ``_i1``, ...,
    its reduction axes ``_r0``, ``_r1``, ... in order): two ops that compute alike over variables
    named apart (an adjoint's come from its tensors' names) come out equal, and lower to one function."""
    outputs = set(op.indices)
    names = {name: f"_i{k}" for k, name in enumerate(op.indices)}
    names |= {name: f"_r{k}" for k, name in enumerate(v for v, _ in op.ranges if v not in outputs)}
    return rename_variables(op, names)


def rename_variables(op: Op, names: Mapping[str, str]) -> Op:
    """A copy of ``op`` with index variables renamed by ``names`` (old → new, all at once) wherever
    they appear: its indices and ranges, reads' and index values' expressions, reduction axes,
    scatter targets."""
    if not names:
        return op
    return replace(
        op,
        indices=tuple(names.get(v, v) for v in op.indices),
        body=rename_in_expression(op.body, names),
        ranges=tuple((names.get(v, v), extent) for v, extent in op.ranges),
        range_sources=tuple((names.get(v, v), source) for v, source in op.range_sources),
        scatter=None if op.scatter is None else tuple(_renamed_index(e, names) for e in op.scatter),
    )


def _renamed_index(expr: sympy.Expr, names: Mapping[str, str]) -> sympy.Expr:
    found = {s: sympy.Symbol(names[s.name], **s.assumptions0) for s in expr.free_symbols if s.name in names}
    return expr.xreplace(found) if found else expr


def rename_in_expression(node: Expr, names: Mapping[str, str]) -> Expr:
    """A copy of value expression ``node`` with index variables renamed by ``names`` (old → new,
    all at once): in reads' and index values' expressions and reduction axes."""
    node = map_children(node, lambda child: rename_in_expression(child, names))
    if isinstance(node, Read | Index):
        node = map_indices(node, lambda expr: _renamed_index(expr, names))
    if isinstance(node, Reduce):
        node = replace(node, axes=tuple(names.get(axis, axis) for axis in node.axes))
    return node


def rename_tensors(op: Op, names: Mapping[str, str]) -> Op:
    """A copy of ``op`` with tensors renamed by ``names`` (old → new) wherever
    they appear: the output, the inputs, reads, and data-dependent indices."""
    if not names:
        return op

    def index(expr: sympy.Expr) -> sympy.Expr:
        return expr.replace(
            lambda e: isinstance(e, AppliedUndef) and e.func.__name__ in names,
            lambda e: sympy.Function(names[e.func.__name__])(*e.args),
        )

    def value(node: Expr) -> Expr:
        node = map_indices(node, index) if isinstance(node, (Read, Index)) else map_children(node, value)
        if isinstance(node, Read) and node.tensor in names:
            return Read(names[node.tensor], node.indices, node.tensor_dtype)
        return node

    def tensor(t: Tensor) -> Tensor:
        return Tensor(names.get(t.name, t.name), t.shape, t.dtype)

    return replace(
        op,
        output=tensor(op.output),
        body=value(op.body),
        inputs=tuple(tensor(t) for t in op.inputs),
        scatter=None if op.scatter is None else tuple(index(e) for e in op.scatter),
    )
