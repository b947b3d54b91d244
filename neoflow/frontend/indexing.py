"""Slicing, gathering, splitting, expanding, tiling, padding and depth/space
rearrangements as tensor expressions (every index map stays affine, so their
adjoints are gathers)."""

from __future__ import annotations

import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import NodeContext, broadcast_index
from neoflow.frontend.registry import converter


def _ints(ctx: NodeContext, i: int, attr: str, what: str, opset_inputs: int) -> list[int] | None:
    """Integer list from input ``i`` (opset >= ``opset_inputs``) or attribute ``attr``."""
    if ctx.opset >= opset_inputs:
        return [int(v) for v in ctx.require_constant(i, what).reshape(-1)] if ctx.has_input(i) else None
    value = ctx.attr(attr)
    return None if value is None else [int(v) for v in value]


@converter("Slice")
def slice_(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    starts = _ints(ctx, 1, "starts", "Slice's starts", 10)
    ends = _ints(ctx, 2, "ends", "Slice's ends", 10)
    axes = _ints(ctx, 3, "axes", "Slice's axes", 10) or list(range(len(starts)))
    steps = _ints(ctx, 4, "steps", "Slice's steps", 10) or [1] * len(starts)
    first = list(range(len(shape)))
    step_of = [1] * len(shape)
    size = list(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= len(shape)
        if step == 0:
            raise ctx.fail("Slice: a step of 0")
        begin, stop, _ = slice(start, end, step).indices(shape[axis])
        first[axis], step_of[axis] = begin, step
        size[axis] = len(range(begin, stop, step))
    x = ctx.input(0)

    def body(v: list[str]) -> str:
        idx = [f"{first[d]} + {step_of[d]}*{n}" if (first[d], step_of[d]) != (0, 1) else n for d, n in enumerate(v)]
        return f"{x}[{', '.join(idx)}]"

    for d in range(len(shape)):
        if d not in [a % len(shape) for a in axes]:
            first[d] = 0
    ctx.define(body, size)


@converter("Gather")
def gather(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    axis = int(ctx.attr("axis", 0)) % len(shape)
    indices = ctx.require_constant(1, "Gather's indices").astype(np.int64)
    indices = np.where(indices < 0, indices + shape[axis], indices)
    if indices.size and (indices.min() < 0 or indices.max() >= shape[axis]):
        raise ctx.fail(f"Gather: an index is outside axis {axis} of size {shape[axis]}")
    x = ctx.input(0)
    out = [*shape[:axis], *indices.shape, *shape[axis + 1 :]]
    if indices.ndim == 0:
        ctx.define(lambda v: f"{x}[{', '.join([*v[:axis], str(int(indices)), *v[axis:]])}]", out)
        return
    table = ctx.constant_table("indices", indices, "int64")

    def body(v: list[str]) -> str:
        inner = v[axis : axis + indices.ndim]
        return f"{x}[{', '.join([*v[:axis], f'{table}[{chr(44).join(inner)}]', *v[axis + indices.ndim :]])}]"

    ctx.define(body, out)


@converter("Split")
def split(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    axis = int(ctx.attr("axis", 0)) % len(shape)
    outputs = [o for o in ctx.node.output]
    sizes = _ints(ctx, 1, "split", "Split's sizes", 13)
    if sizes is None:
        parts = int(ctx.attr("num_outputs", len(outputs)))
        chunk = -(-shape[axis] // parts)
        sizes = [min(chunk, shape[axis] - k * chunk) for k in range(parts)]
    if sum(sizes) != shape[axis] or len(sizes) != len(outputs):
        raise ctx.fail(f"Split: sizes {sizes} do not split axis {axis} of size {shape[axis]} into {len(outputs)}")
    x = ctx.input(0)
    offset = 0
    for k, size in enumerate(sizes):
        out = list(shape)
        out[axis] = size

        def body(v: list[str], offset: int = offset) -> str:
            idx = list(v)
            idx[axis] = f"{v[axis]} + {offset}" if offset else v[axis]
            return f"{x}[{', '.join(idx)}]"

        if outputs[k]:
            ctx.define(body, out, k=k)
        offset += size


@converter("Expand")
def expand(ctx: NodeContext) -> None:
    target = [int(s) for s in ctx.require_constant(1, "Expand's shape")]
    shape = ctx.shape(0)
    out = tuple(np.broadcast_shapes(shape, tuple(target)))
    x = ctx.input(0)
    ctx.define(lambda v: f"{x}[{broadcast_index(shape, out, v)}]", out)


@converter("Tile")
def tile(ctx: NodeContext) -> None:
    repeats = [int(r) for r in ctx.require_constant(1, "Tile's repeats")]
    shape = ctx.shape(0)
    x = ctx.input(0)
    out = [s * r for s, r in zip(shape, repeats, strict=True)]
    ctx.define(
        lambda v: f"{x}[{', '.join(n if r == 1 else f'{n}%{s}' for n, s, r in zip(v, shape, repeats, strict=True))}]",
        out,
    )


@converter("Pad")
def pad(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    rank = len(shape)
    pads = _ints(ctx, 1, "pads", "Pad's pads", 11)
    mode = ctx.attr("mode", "constant")
    value = (
        ctx.attr("value", 0.0)
        if ctx.opset < 11
        else (float(ctx.constant(2).reshape(-1)[0]) if ctx.has_input(2) and ctx.constant(2) is not None else 0.0)
    )
    axes = _ints(ctx, 3, "axes", "Pad's axes", 18) if ctx.opset >= 18 else None
    axes = [a % rank for a in axes] if axes else list(range(rank))
    begin, end = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[k + len(axes)]
    if any(p < 0 for p in begin + end):
        raise ctx.fail("Pad: negative pads are not supported", UnsupportedOpError)
    x = ctx.input(0)
    out = [s + b + e for s, b, e in zip(shape, begin, end, strict=True)]

    if mode == "constant":

        def body(v: list[str]) -> str:
            inner = [f"{n} - {b}" if b else n for n, b in zip(v, begin, strict=True)]
            guard = " && ".join(
                f"{n} >= {b} && {n} < {b + s}"
                for d, (n, b, s) in enumerate(zip(v, begin, shape, strict=True))
                if b or out[d] != s
            )
            read = f"{x}[{', '.join(inner)}]"
            return f"Select({guard}, {read}, {value!r})" if guard else read

        ctx.define(body, out)
        return
    if mode not in ("edge", "reflect", "wrap"):
        raise ctx.fail(f"Pad mode '{mode}' is not supported", UnsupportedOpError)
    padded = [d for d in range(rank) if begin[d] or end[d]]
    current, current_shape = x, list(shape)
    for step, d in enumerate(padded):  # one axis at a time: each step is a three-way Select
        size, b = shape[d], begin[d]
        target_shape = list(current_shape)
        target_shape[d] = out[d]

        def body(v: list[str], d: int = d, size: int = size, b: int = b, source: str = current) -> str:
            n = v[d]
            sources = {
                "edge": ("0", str(size - 1)),
                "reflect": (f"{b} - {n}", f"{2 * (size - 1) + b} - {n}"),
                "wrap": (f"{n} + {size - b}", f"{n} - {b + size}"),
            }[mode]

            def read(position: str) -> str:
                return f"{source}[{', '.join(position if k == d else m for k, m in enumerate(v))}]"

            return (
                f"Select({n} < {b}, {read(sources[0])}, Select({n} >= {b + size}, {read(sources[1])}, "
                f"{read(f'{n} - {b}' if b else n)}))"
            )

        last = step == len(padded) - 1
        current = ctx.define(body, target_shape, name=None if last else ctx.model.fresh(f"{ctx.output()}_pad{d}"))
        current_shape = target_shape
    if not padded:
        ctx.elementwise("{0}", [0])


def _blocksize(ctx: NodeContext, channels: int | None = None) -> int:
    """The node's ``blocksize``: positive, and (``DepthToSpace``) dividing ``channels`` in squares."""
    b = ctx.attr("blocksize")
    if not isinstance(b, int) or b < 1:
        raise ctx.fail(f"blocksize must be a positive integer, got {b!r}")
    if channels is not None and channels % (b * b):
        raise ctx.fail(f"its {channels} input channels are not a multiple of blocksize^2 = {b * b}")
    return b


@converter("DepthToSpace")
def depth_to_space(ctx: NodeContext) -> None:
    n, c, h, w = ctx.shape(0)
    b = _blocksize(ctx, c)
    x = ctx.input(0)
    out_c = c // (b * b)
    if ctx.attr("mode", "DCR") == "DCR":
        channel = f"(i2%{b})*{b * out_c} + (i3%{b})*{out_c} + i1"
    else:
        channel = f"i1*{b * b} + (i2%{b})*{b} + i3%{b}"
    ctx.define(f"{x}[i0, {channel}, i2//{b}, i3//{b}]", (n, out_c, h * b, w * b))


@converter("SpaceToDepth")
def space_to_depth(ctx: NodeContext) -> None:
    n, c, h, w = ctx.shape(0)
    b = _blocksize(ctx)
    if h % b or w % b:
        raise ctx.fail(f"its {h} x {w} input is not a multiple of blocksize {b}")
    x = ctx.input(0)
    ctx.define(f"{x}[i0, i1%{c}, i2*{b} + i1//{c * b}, i3*{b} + i1//{c}%{b}]", (n, c * b * b, h // b, w // b))


@converter("Range")
def range_(ctx: NodeContext) -> None:
    start, limit, delta = (ctx.require_constant(i, "Range's bounds") for i in range(3))
    ctx.set_constant(0, np.arange(start, limit, delta, dtype=np.asarray(start).dtype))
