"""Shape-changing ONNX ops and import-time constants."""

from __future__ import annotations

import math

import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import NodeContext, to_array
from neoflow.frontend.registry import converter


def _axis(ctx: NodeContext, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ctx.fail(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def reshape_to(ctx: NodeContext, x: str, in_shape, out_shape, name: str | None = None) -> str:
    """Define a row-major reshape of ``x`` (``name`` or output 0)."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise ctx.fail(f"cannot reshape {list(in_shape)} into {list(out_shape)}")

    def body(v: list[str]) -> str:
        strides = [math.prod(out_shape[d + 1 :]) for d in range(len(out_shape))]
        flat = " + ".join(f"{s}*{n}" for s, n in zip(strides, v, strict=True) if out_shape[v.index(n)] > 1) or "0"
        parts = []
        for d, size in enumerate(in_shape):
            inner = math.prod(in_shape[d + 1 :])
            parts.append("0" if size == 1 else f"({flat})//{inner}%{size}")
        return f"{x}[{', '.join(parts)}]"

    return ctx.define(body, out_shape, name=name)


@converter("Reshape")
def reshape(ctx: NodeContext) -> None:
    shape = ctx.attr("shape") if ctx.opset < 5 else ctx.require_constant(1, "Reshape's shape")
    shape = [int(s) for s in np.asarray(shape).reshape(-1)]
    in_shape = ctx.shape(0)
    allow_zero = int(ctx.attr("allowzero", 0))
    out = [in_shape[d] if s == 0 and not allow_zero else s for d, s in enumerate(shape)]
    if out.count(-1) > 1:
        raise ctx.fail("Reshape: more than one -1 in the target shape")
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        out[out.index(-1)] = math.prod(in_shape) // known if known else 0
    reshape_to(ctx, ctx.input(0), in_shape, out)


@converter("Flatten")
def flatten(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    axis = int(ctx.attr("axis", 1))
    axis = axis % len(shape) if axis < 0 else axis
    reshape_to(ctx, ctx.input(0), shape, (math.prod(shape[:axis]), math.prod(shape[axis:])))


def _axes(ctx: NodeContext, attr_before: int) -> list[int] | None:
    if ctx.opset < attr_before:
        axes = ctx.attr("axes")
        return None if axes is None else list(axes)
    if not ctx.has_input(1):
        return None
    return [int(a) for a in ctx.require_constant(1, "axes")]


@converter("Squeeze")
def squeeze(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    axes = _axes(ctx, 13)
    axes = [d for d, s in enumerate(shape) if s == 1] if axes is None else [_axis(ctx, a, len(shape)) for a in axes]
    reshape_to(ctx, ctx.input(0), shape, [s for d, s in enumerate(shape) if d not in axes])


@converter("Unsqueeze")
def unsqueeze(ctx: NodeContext) -> None:
    shape = list(ctx.shape(0))
    axes = _axes(ctx, 13) or []
    rank = len(shape) + len(axes)
    for a in sorted(_axis(ctx, a, rank) for a in axes):
        shape.insert(a, 1)
    reshape_to(ctx, ctx.input(0), ctx.shape(0), shape)


@converter("Transpose")
def transpose(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    perm = list(ctx.attr("perm", list(range(len(shape)))[::-1]))
    if sorted(perm) != list(range(len(shape))):
        raise ctx.fail(f"Transpose: perm {perm} is not a permutation of the {len(shape)} axes", UnsupportedOpError)
    x = ctx.input(0)

    def body(v: list[str]) -> str:
        source = [""] * len(shape)
        for out_dim, in_dim in enumerate(perm):
            source[in_dim] = v[out_dim]
        return f"{x}[{', '.join(source)}]"

    ctx.define(body, [shape[p] for p in perm])


@converter("Concat")
def concat(ctx: NodeContext) -> None:
    values = [ctx.constant(i) for i in range(len(ctx.node.input))]
    if all(v is not None for v in values):  # shape arithmetic: fold directly (parts may be empty)
        ctx.set_constant(0, np.concatenate(values, axis=int(ctx.attr("axis"))))
        return
    names = [ctx.input(i) for i in range(len(ctx.node.input))]
    shapes = [ctx.shape(i) for i in range(len(names))]
    axis = _axis(ctx, int(ctx.attr("axis")), len(shapes[0]))
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)

    def body(v: list[str]) -> str:
        offsets = np.cumsum([0] + [s[axis] for s in shapes])
        text = ""
        for i, name in enumerate(names):
            idx = list(v)
            idx[axis] = f"{v[axis]} - {offsets[i]}" if offsets[i] else v[axis]
            read = f"{name}[{', '.join(idx)}]"
            text = read if i == 0 else f"Select({v[axis]} < {offsets[i]}, {text}, {read})"
        return text

    ctx.define(body, out)


@converter("Constant")
def constant(ctx: NodeContext) -> None:
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in ctx.attributes:
            value = ctx.attributes[key]
            ctx.set_constant(0, to_array(value) if key == "value" else np.asarray(value))
            return
    raise ctx.fail("Constant without a supported value attribute", UnsupportedOpError)


@converter("ConstantOfShape")
def constant_of_shape(ctx: NodeContext) -> None:
    shape = [int(s) for s in ctx.require_constant(0, "ConstantOfShape's shape")]
    value = to_array(ctx.attributes["value"]) if "value" in ctx.attributes else np.zeros(1, np.float32)
    ctx.set_constant(0, np.full(shape, value.reshape(-1)[0], dtype=value.dtype))


@converter("Shape")
def shape_of(ctx: NodeContext) -> None:
    shape = np.asarray(ctx.shape(0), dtype=np.int64)
    start, end = int(ctx.attr("start", 0)), ctx.attr("end")
    ctx.set_constant(0, shape[start : None if end is None else int(end)])


@converter("Size")
def size_of(ctx: NodeContext) -> None:
    ctx.set_constant(0, np.asarray(math.prod(ctx.shape(0)), dtype=np.int64))
