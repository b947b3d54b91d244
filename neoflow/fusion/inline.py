"""Inlining: substitute a producer's expression for the consumer's reads of it.

Inlining is how a fused kernel avoids writing a tensor to memory: the consumer
recomputes the producer's value at each point it reads, so ``B[i] = A[i] * 2``
inlined into ``C[i] = B[i + 1] + 1`` gives ``C[i] = A[i + 1] * 2 + 1``.  A
producer's reduction axes are renamed so they cannot clash with the consumer's
variables, and its value is cast to its declared dtype where the expression's
own dtype differs, so a fused op rounds exactly as the unfused pair did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import sympy

from neoflow.errors import CompileError
from neoflow.ir import bounds, index
from neoflow.ir import dtypes as dt
from neoflow.ir.expr import Cast, Expr, Read, Reduce, map_children, map_indices
from neoflow.ir.op import Op, Tensor
from neoflow.ir.simplify import drop_idle_clamps, fold_selects, simplify_index

#: ``inline_all``'s memo: an op's substituted form by its name and the inlined ops it reaches.
InlineMemo = dict[tuple[str, frozenset[str]], Op]


def _rename_axes(node: Expr, names: Mapping[str, str]) -> Expr:
    """``node`` with the reduction axes in ``names`` renamed (binders and uses)."""
    symbols = {index.var(old): index.var(new) for old, new in names.items()}
    node = map_indices(node, lambda e: e.xreplace(symbols))

    def rename(n: Expr) -> Expr:
        n = map_children(n, rename)
        if isinstance(n, Reduce):
            return Reduce(n.kind, tuple(names.get(a, a) for a in n.axes), n.extents, n.body, n.where)
        return n

    return rename(node)


def _value_at(producer: Op, point: tuple[sympy.Expr, ...], axes: Mapping[str, str]) -> Expr:
    """The producer's value at ``point`` (its reduction axes renamed by ``axes``)."""
    body = _rename_axes(producer.body, axes) if axes else producer.body
    at = {index.var(v): e for v, e in zip(producer.indices, point, strict=True)}
    body = map_indices(body, lambda e: e.xreplace(at))
    if dt.concrete(body.dtype) != producer.dtype:
        body = Cast(producer.dtype, body)
    return body


def why_not_inlined(consumer: Op, producer: Op) -> str | None:
    """Why ``producer`` cannot be inlined into ``consumer``, or None when it can:
    a scatter-add has no value at a point, and a read inside an index (a
    data-dependent index, ``X[I[i]]``) is not a value read to substitute."""
    if producer.scatter is not None:
        return f"'{producer.name}' is a scatter-add: it cannot be inlined, materialise it"
    probes = [consumer.body]
    if consumer.scatter is not None:
        probes.append(Read(consumer.name, consumer.scatter, "int64"))
    for probe in probes:
        for access in bounds.accesses(probe):
            for expr in access.read.indices:
                if any(call.func.__name__ == producer.name for call in index.data_reads(expr)):
                    return f"'{consumer.name}' reads '{producer.name}' inside an index: it cannot be inlined"
    return None


def inline(consumer: Op, producer: Op) -> Op:
    """``consumer`` with every read of ``producer``'s output replaced by the
    producer's expression at the read's indices.  Raises ``CompileError`` for a
    scatter-add producer (it has no value at a point) or a read of the
    producer inside an index (a data-dependent index is not inlined)."""
    reason = why_not_inlined(consumer, producer)
    if reason is not None:
        raise CompileError(reason, op=consumer.name)
    taken = {name for name, _ in consumer.ranges} | set(producer.indices) | {name for name, _ in producer.ranges}
    extents = dict(producer.ranges)
    new_ranges = dict(consumer.ranges)
    reads = 0

    def substitute(node: Expr) -> Expr:
        nonlocal reads
        if isinstance(node, Read) and node.tensor == producer.name:
            reads += 1
            axes = {a: index.fresh_name(f"{a}_{producer.name}", taken) for a in producer.reduce_axes}
            for old, new in axes.items():
                new_ranges[new] = extents[old]
            return _value_at(producer, node.indices, axes)
        return map_children(node, substitute)

    body = substitute(consumer.body)
    if not reads:
        return consumer
    # the producer's indices at the consumer's points: a reshape's divisions often resolve there,
    # and so do the conditions of its selects (a concatenation read in one of its parts)
    body = map_indices(body, lambda expr: simplify_index(expr, new_ranges))
    body = fold_selects(body, new_ranges)
    return replace(
        consumer,
        body=body,
        inputs=_inputs(body, consumer, producer),
        ranges=tuple(new_ranges.items()),
        range_sources=(),
    )


def _inputs(body: Expr, consumer: Op, producer: Op) -> tuple[Tensor, ...]:
    """The tensors ``body`` reads, in order of first appearance."""
    known = {t.name: t for t in (*consumer.inputs, *producer.inputs)}
    found: dict[str, Tensor] = {}
    targets = [a.read for a in bounds.accesses(body)]
    if consumer.scatter is not None:
        probe = Read(consumer.name, consumer.scatter, "int64")
        targets += [a.read for a in bounds.accesses(probe) if a.read.tensor != consumer.name]
    for read in targets:
        if read.tensor in known:
            found.setdefault(read.tensor, known[read.tensor])
    return tuple(found.values())


def inline_all(ops: Iterable[Op], inlined: Iterable[str], memo: InlineMemo | None = None) -> list[Op]:
    """The ops of a kernel that are not in ``inlined``, each with every
    inlined op it reads (directly or through other inlined ops) substituted.
    ``ops`` are in topological order.  ``memo`` (for ops of one graph) keeps each
    op's substituted form by the inlined ops it reaches, for other kernels to reuse."""
    names = set(inlined)
    done: dict[str, Op] = {}
    reached: dict[str, frozenset[str]] = {}
    roots = []
    for op in ops:
        reach = frozenset(name for t in op.inputs if t.name in names for name in (t.name, *reached[t.name]))
        fused = memo.get((op.name, reach)) if memo is not None else None
        if fused is None:
            fused = op
            for tensor in op.inputs:
                if tensor.name in names:
                    fused = inline(fused, done[tensor.name])
            if memo is not None:
                memo[(op.name, reach)] = fused
        if op.name in names:
            done[op.name], reached[op.name] = fused, reach
        else:
            roots.append(fused)
    return roots


#: a pointwise producer is recomputed in place of a read of its output (``recompute_from_reads``) when its
#: expression has at most this many nodes (a clip or a ReLU: a comparison or two)
RECOMPUTED_NODES = 12


def _pointwise(op: Op) -> bool:
    """Whether ``op`` computes each point from its inputs' elements at that very point (every read
    at ``op``'s own indices, in order; no reduction, no scatter), cheaply (``RECOMPUTED_NODES``)."""
    if op.scatter is not None:
        return False
    own = tuple(index.var(v) for v in op.indices)
    nodes = list(op.body.walk())
    if len(nodes) > RECOMPUTED_NODES or any(isinstance(node, Reduce) for node in nodes):
        return False
    shapes = {t.name: t.shape for t in op.inputs}
    reads = [node for node in nodes if isinstance(node, Read)]
    return bool(reads) and all(r.indices == own and shapes.get(r.tensor) == op.shape for r in reads)


def recompute_from_reads(op: Op, producers: Mapping[str, Op]) -> Op:
    """``op`` with each tensor it reads that a cheap pointwise producer (``producers``: op by
    output name) computes from tensors ``op`` already reads at the same points recomputed from
    those reads instead: one tensor fewer to read; then comparisons of clamps simplified
    (``drop_idle_clamps``, also where the plan inlined the clamp).  A ReLU6's derivative
    ``[0 < x] [clip(x) < 6]`` then reads the BatchNorm output ``x`` alone, as ``[0 < x] [x < 6]``,
    not the clipped tensor as well."""
    for tensor in op.inputs:
        producer = producers.get(tensor.name)
        if producer is None or not _pointwise(producer):
            continue
        reads = [node for node in op.body.walk() if isinstance(node, Read)]
        points = {r.indices for r in reads if r.tensor == tensor.name}
        if len(points) != 1:
            continue
        (point,) = points
        have = {(r.tensor, r.indices) for r in reads if r.tensor != tensor.name}
        needed = {(r.tensor, point) for r in producer.body.walk() if isinstance(r, Read)}
        if needed <= have:
            op = inline(op, producer)
    body = drop_idle_clamps(op.body)
    return op if body == op.body else replace(op, body=body)
