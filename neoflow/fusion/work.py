"""How much an op computes and reads: the counts the patterns and the cost model use.

Every count is per call of the op: an expression node inside a reduction is
evaluated once per output point and reduction point (lattice domains thinned
by ``bounds.reduction_points``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neoflow.ir.bounds import reduction_points
from neoflow.ir.expr import ARITHMETIC, Binary, Expr, Read, Reduce, Unary
from neoflow.ir.op import Op

#: Relative cost of a transcendental function against one add or multiply.
FUNCTION_FLOPS = 8


@dataclass(frozen=True)
class Work:
    """``flops``: arithmetic operations; ``reads``: element reads per input
    tensor (with repeats: a 3x3 convolution reads each input element about 9
    times); ``reduction``: reduction points per output point (0 for none)."""

    flops: float
    reads: dict[str, float]
    reduction: float


def op_work(op: Op) -> Work:
    """The arithmetic and element reads of one call of ``op``."""
    outer = float(math.prod(op.shape)) if op.scatter is None else float(math.prod(op.extent[v] for v in op.indices))
    flops = 0.0
    reads: dict[str, float] = {}
    deepest = 0.0

    def visit(node: Expr, times: float, depth: float) -> None:
        nonlocal flops, deepest
        if isinstance(node, Reduce):
            points = reduction_points(node, op.extent)
            depth = depth * points if depth else points
            deepest = max(deepest, depth)
            times *= points
            flops += times  # the combine
        elif isinstance(node, Read):
            reads[node.tensor] = reads.get(node.tensor, 0.0) + times
        elif isinstance(node, Binary) and (node.op in ARITHMETIC or node.op in ("max", "min", "pow")):
            flops += times * (FUNCTION_FLOPS if node.op == "pow" else 1)
        elif isinstance(node, Unary) and node.op not in ("-", "!", "abs"):
            flops += times * FUNCTION_FLOPS
        for child in node.children():
            visit(child, times, depth)

    visit(op.body, outer, 0.0)
    return Work(flops, reads, deepest)
