"""Light and heavy ops, and the four producer → consumer fusion patterns.

*Light* ops are element-wise or injective (activations, padding,
depth-to-space, transposes, concatenation, slices, broadcasts, optimizer
updates): each output point reads a bounded handful of input points.
*Heavy* ops reduce (convolutions, matmuls, capsule convolutions, pooling,
norms, losses): each output point combines many input points.  A producer →
consumer edge is one of light→light, light→heavy (a prologue), heavy→light
(an epilogue) and heavy→heavy (a compute-intensive chain).
"""

from __future__ import annotations

import math
from functools import lru_cache

from neoflow.fusion.work import op_work
from neoflow.ir import index
from neoflow.ir.expr import Expr, Read, Reduce
from neoflow.ir.op import Op

LIGHT, HEAVY = "light", "heavy"
PATTERNS = ("light→light", "light→heavy", "heavy→light", "heavy→heavy")


@lru_cache(maxsize=8192)
def kind(op: Op) -> str:
    """``heavy`` when a reduction of ``op`` combines more than one point per
    output point (a scatter-add counts as heavy), else ``light``."""
    if op.scatter is not None:
        return HEAVY
    return HEAVY if op_work(op).reduction > 1 else LIGHT


def recomputable(op: Op, terms: int = 0) -> bool:
    """Whether the search may recompute ``op`` inside its readers: a light op (``kind``), or a
    reduction of at most ``terms`` terms an output point (``Machine.recomputed_terms``); never a
    scatter-add."""
    return kind(op) == LIGHT or (op.scatter is None and op_work(op).reduction <= terms)


def pattern(producer: Op, consumer: Op) -> str:
    """The pattern of the edge ``producer`` → ``consumer``, e.g. ``heavy→light``."""
    return f"{kind(producer)}→{kind(consumer)}"


def reads_of(consumer: Op, producer: str) -> list[tuple[Read, bool]]:
    """Each read of ``producer`` in ``consumer``, with whether it sits inside a
    reduction of the consumer."""
    found: list[tuple[Read, bool]] = []

    def visit(node: Expr, inside: bool) -> None:
        if isinstance(node, Read) and node.tensor == producer:
            found.append((node, inside))
        for child in node.children():
            visit(child, inside or isinstance(node, Reduce))

    visit(consumer.body, False)
    return found


def is_epilogue(producer: Op, consumer: Op) -> bool:
    """True when ``consumer`` reads ``producer`` only at its own output point
    (the indices are the consumer's index variables, each once, outside any
    reduction): inlining then computes each producer point exactly once."""
    found = reads_of(consumer, producer.name)
    if not found or consumer.scatter is not None:
        return False
    own = [index.var(v) for v in consumer.indices]
    first = found[0][0].indices
    for read, inside in found:
        if inside or read.indices != first:
            return False
    return len(first) == len(own) and set(first) == set(own)


def recompute_factor(producer: Op, consumer: Op) -> float:
    """How many times inlining ``producer`` into ``consumer`` evaluates each
    producer point on average (1 for an epilogue, 9 for a 3x3 window, 0 when
    the consumer does not read it)."""
    reads = op_work(consumer).reads.get(producer.name, 0.0)
    return reads / max(1, math.prod(producer.shape))
