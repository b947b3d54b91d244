"""Softmax, LogSoftmax and the Reduce* family as tensor expressions."""

from __future__ import annotations

import math

from neoflow.frontend.context import NodeContext
from neoflow.frontend.registry import converter
from neoflow.ir.index import index_vars


def _reduce(
    ctx: NodeContext, x: str, shape, axes: list[int], kind: str, term: str, keep: bool, name: str | None = None
) -> str:
    """Define ``name`` (or output 0) as ``kind`` of ``term`` over ``axes``; ``term`` uses
    ``{}`` for the element read."""
    out_shape = (
        [1 if d in axes else s for d, s in enumerate(shape)]
        if keep
        else [s for d, s in enumerate(shape) if d not in axes]
    )

    def body(v: list[str]) -> str:
        it = iter(v)
        idx = []
        for d in range(len(shape)):
            if d in axes:
                idx.append(f"k{d}")
                if keep:
                    next(it)
            else:
                idx.append(next(it))
        read = f"{x}[{', '.join(idx)}]"
        return f"{kind}({{{', '.join(f'k{d}' for d in axes)}}}, {term.format(read)})"

    return ctx.define(body, out_shape, name=name)


def _softmax_axes(ctx: NodeContext, rank: int) -> list[int]:
    if ctx.opset < 13:
        axis = int(ctx.attr("axis", 1)) % rank
        return list(range(axis, rank))  # the input is seen as 2-D at ``axis``
    return [int(ctx.attr("axis", -1)) % rank]


@converter("Softmax", "LogSoftmax")
def softmax(ctx: NodeContext) -> None:
    x, shape = ctx.input(0), ctx.shape(0)
    axes = _softmax_axes(ctx, len(shape))
    peak = _reduce(ctx, x, shape, axes, "ReduceMax", "{}", True, name=ctx.model.fresh(f"{ctx.output()}_max"))
    v = index_vars(len(shape))
    kept = ", ".join("0" if d in axes else n for d, n in enumerate(v))
    shifted = ctx.define(f"{x}[{', '.join(v)}] - {peak}[{kept}]", shape, name=ctx.model.fresh(f"{ctx.output()}_shift"))
    total = _reduce(
        ctx, shifted, shape, axes, "ReduceAdd", "exp({})", True, name=ctx.model.fresh(f"{ctx.output()}_sum")
    )
    if ctx.node.op_type == "Softmax":
        ctx.define(f"exp({shifted}[{', '.join(v)}]) / {total}[{kept}]", shape)
    else:
        ctx.define(f"{shifted}[{', '.join(v)}] - log({total}[{kept}])", shape)


REDUCTIONS = {
    "ReduceSum": ("ReduceAdd", "{}"),
    "ReduceMean": ("ReduceAdd", "{}"),
    "ReduceMax": ("ReduceMax", "{}"),
    "ReduceMin": ("ReduceMin", "{}"),
    "ReduceProd": ("ReduceMul", "{}"),
    "ReduceSumSquare": ("ReduceAdd", "{0} * {0}"),
    "ReduceL2": ("ReduceAdd", "{0} * {0}"),
    "ReduceL1": ("ReduceAdd", "abs({})"),
}


@converter(*REDUCTIONS)
def reduce(ctx: NodeContext) -> None:
    x, shape = ctx.input(0), ctx.shape(0)
    op = ctx.node.op_type
    takes_input = ctx.opset >= (13 if op == "ReduceSum" else 18)
    if takes_input:
        axes = [int(a) for a in ctx.require_constant(1, "axes")] if ctx.has_input(1) else None
    else:
        axes = ctx.attr("axes")
    if not axes:
        if int(ctx.attr("noop_with_empty_axes", 0)):
            ctx.elementwise("{0}", [0])
            return
        axes = list(range(len(shape)))
    axes = sorted(int(a) % len(shape) for a in axes)
    keep = bool(int(ctx.attr("keepdims", 1)))
    kind, term = REDUCTIONS[op]
    if op in ("ReduceMean", "ReduceL2"):
        inner = _reduce(ctx, x, shape, axes, kind, term, keep, name=ctx.model.fresh(f"{ctx.output()}_acc"))
        t = ctx.model.tensors[inner]
        scale = math.prod(shape[a] for a in axes)
        template = "{0} / " + str(scale) if op == "ReduceMean" else "sqrt({0})"
        v = index_vars(len(t.shape))
        ctx.define(template.format(f"{inner}[{', '.join(v)}]"), t.shape)
    else:
        _reduce(ctx, x, shape, axes, kind, term, keep)
