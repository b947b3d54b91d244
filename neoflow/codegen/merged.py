"""Element-wise ops over short inner extents, lowered over merged trailing dimensions.

An element-wise op whose every read is at the op's own point (or a scalar)
touches each tensor in its flat order, so the loop nest over its shape can run
over any grouping of that shape's dimensions.  The printed nest follows the
shape: a conv weight's optimizer update ``[64, 64, 3, 3]`` or a capsule
tensor's ``[..., 2, 2]`` poses has an innermost loop of 3 or 2, too short for
vector lanes.  ``merged_inner`` regroups the trailing dimensions into one of at
least ``MIN_INNER`` elements (``[64, 576]``, ``[4, 144]``), which keeps an outer
loop to share out among threads and the element-wise nest's row buffers, and
gives the inner loop whole vectors.  The tensors keep their memory; only the
indices the kernel computes change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from neoflow.ir import index
from neoflow.ir.expr import Expr, Index, Read, map_children
from neoflow.ir.op import Op, Tensor

#: An innermost extent this short is merged with the dimensions before it (16-lane vectors, a few of them).
MIN_INNER = 64


def merged_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``shape`` with its trailing dimensions merged into one of at least
    ``MIN_INNER`` elements (all of them where the whole is smaller); None where
    the innermost is long enough already, nothing would merge or it is empty."""
    if len(shape) < 2 or shape[-1] >= MIN_INNER or 0 in shape:
        return None
    first, inner = len(shape) - 1, shape[-1]
    while first > 0 and inner < MIN_INNER:
        first -= 1
        inner *= shape[first]
    return (*shape[:first], inner)


def merged_inner(op: Op) -> Op | None:
    """``op`` over its ``merged_shape``, or None where it does not apply: the op
    must be element-wise (no reduction, no scatter) and read every tensor either
    at its own point, with the op's shape, or at indices among those the regrouping
    keeps (a scalar; a BatchNorm's per-channel scale over 8x8 maps); no index may be
    used as a value."""
    if op.scatter is not None or op.reductions:
        return None
    shape = merged_shape(op.shape)
    if shape is None:
        return None
    point = tuple(index.var(v) for v in op.indices)
    pointwise = {t.name for t in op.inputs if t.shape == op.shape}
    indices = op.indices[: len(shape)]
    kept = set(indices[:-1])  # the indices the regrouping leaves as they are

    def at_point(read: Read) -> bool:
        return read.tensor in pointwise and tuple(read.indices) == point

    def outside(read: Read) -> bool:  # a BatchNorm's per-channel scale: the merged dimensions unread
        return all(index.variables(i) <= kept for i in read.indices)

    for node in op.body.walk():
        if isinstance(node, Index):
            return None
        if isinstance(node, Read) and node.indices and not at_point(node) and not outside(node):
            return None
    new_point = tuple(index.var(v) for v in indices)

    def regrouped(node: Expr) -> Expr:
        if isinstance(node, Read):  # at the op's point; one outside the merged dimensions keeps its indices
            return Read(node.tensor, new_point, node.tensor_dtype) if node.indices and at_point(node) else node
        return map_children(node, regrouped)

    inputs = tuple(Tensor(t.name, shape, t.dtype) if t.name in pointwise else t for t in op.inputs)
    return replace(
        op,
        output=Tensor(op.name, shape, op.dtype),
        indices=indices,
        body=regrouped(op.body),
        inputs=inputs,
        ranges=tuple(zip(indices, shape, strict=True)),
        range_sources=(),
    )


def merged_group(ops: Sequence[Op]) -> list[Op] | None:
    """Every op of ``ops`` over merged trailing dimensions where all have one
    shape and ``merged_inner`` applies to each; None otherwise."""
    if len({op.shape for op in ops}) != 1:
        return None
    merged = [merged_inner(op) for op in ops]
    return None if any(op is None for op in merged) else merged
