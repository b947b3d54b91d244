"""Contractions over a depth of short runs, their operands first copied flat along it.

A small convolution's weight gradient,
``dW[k, r, s, j] = ReduceAdd({b, p, q}, dY[b, k, p, q, j] * X[b, p + r, q + s])``, has a
small output (the capsule network's: 72 elements) and a long depth (``b, p, q``: 576
terms a slice of 16 rows) whose innermost run is short (``q``: 6).  As a loop nest each
output sums its depth in runs of 6, a vector reduction and its horizontal sum every six
terms; the blocked kernel packs both operands element by element through tables.  Copied
first into two buffers laid out ``[side variables..., depth...]``,

    Pa[k, j, b, p, q] = dY[b, k, p, q, j]          Pb[r, s, b, p, q] = X[b, p + r, q + s]
    dW[k, r, s, j]    = ReduceAdd({d}, Pa[k, j, d] * Pb[r, s, d])

each output is one dot product of two contiguous rows as long as the whole depth, which
the loop nest runs in vector lanes.  Measured on that op (one thread, AVX-512): 18.7 µs as
a loop nest, 3.5 µs packed flat (1.3 µs of it the copies).

``flat_depth_plan`` takes the form where the depth's innermost run (its last axis longer
than one) is shorter than a vector, the depth holds several vectors, the copies are small
and the cycle estimate beats the op's other schedules; ``lower.flat_function`` emits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from neoflow.codegen.lattice import sum_of_product, with_reduce
from neoflow.ir import index
from neoflow.ir.expr import Binary, Read, Reduce
from neoflow.ir.op import Op, Tensor
from neoflow.targets.cpu.gemm import unsplit_cycles
from neoflow.targets.cpu.staging import staged_plan

#: floats in one vector: a depth run shorter than this is short, and a dot product takes
#: a vector step per this many terms
LANES = 16
#: the depth must hold at least this many vectors for a dot product to outweigh its horizontal sum
MIN_DEPTH_VECTORS = 4
#: the two copies together stay within this many bytes (a core's L2 holds them)
MAX_PACK_BYTES = 512 * 1024
#: estimated cycles: an element copied, a vector step of a dot product (one accumulator's
#: FMA latency), the horizontal sum and store closing each output
COPY_CYCLES, DOT_STEP_CYCLES, CLOSE_CYCLES = 1.0, 4.0, 8.0
#: the plan is taken when its estimate is below this share of the op's other schedules'
GAIN = 0.8


@dataclass(frozen=True)
class FlatDepthPlan:
    """``packs``: the two copies (ops over ``[side..., depth...]``, operand ``a``'s then
    ``b``'s); ``product``: the op's output from them, one sum over the flat depth
    variable, reading each copy as ``[side..., depth]``; ``depth``: its terms; ``run``:
    the original depth's innermost run (its last axis longer than one); ``cycles``:
    the estimate."""

    packs: tuple[Op, Op]
    product: Op
    depth: int
    run: int
    cycles: float


def flat_form(op: Op) -> FlatDepthPlan | None:
    """The copies and the flat product for a float32 op whose body is a sum (no domain
    condition) of a product of two reads, under an optional epilogue; None for any other
    op.  A copy's side variables are the output indices its read uses, in output order;
    ``cycles`` is the estimate of running them."""
    parts = sum_of_product(op)
    if parts is None or any(t.dtype != "float32" for t in op.inputs):
        return None
    reduce, epilogue, left, right = parts
    if reduce.where is not None:
        return None
    extent = op.extent
    tensors = {t.name: t for t in op.inputs}
    depth = math.prod(extent[axis] for axis in reduce.axes)
    taken = set(extent)
    flat = index.fresh_name("d", taken)
    packs, reads = [], []
    for side, read in zip("ab", (left, right), strict=True):
        used = set().union(*(e.free_symbols for e in read.indices))
        variables = tuple(v for v in op.indices if index.var(v) in used)
        shape = tuple(extent[v] for v in variables)
        name = f"{op.name}_pack_{side}"
        packs.append(
            Op(
                Tensor(name, (*shape, *(extent[a] for a in reduce.axes)), "float32"),
                (*variables, *reduce.axes),
                read,
                (tensors[read.tensor],),
                tuple((v, extent[v]) for v in (*variables, *reduce.axes)),
            )
        )
        reads.append((Read(name, (*(index.var(v) for v in variables), index.var(flat)), "float32"), (*shape, depth)))
    summed = Reduce("ReduceAdd", (flat,), (depth,), Binary("*", reads[0][0], reads[1][0]))
    body = with_reduce(epilogue, summed)
    flat_tensors = {**tensors, **{read.tensor: Tensor(read.tensor, shape, "float32") for read, shape in reads}}
    read_names = dict.fromkeys(n.tensor for n in body.walk() if isinstance(n, Read))
    flat_op = Op(
        op.output,
        op.indices,
        body,
        tuple(flat_tensors[name] for name in read_names),
        (*((v, extent[v]) for v in op.indices), (flat, depth)),
    )
    points = math.prod(extent[v] for v in op.indices)
    copies = sum(pack.output.size for pack in packs)
    cycles = copies * COPY_CYCLES + points * (-(-depth // LANES) * DOT_STEP_CYCLES + CLOSE_CYCLES)
    run = [extent[axis] for axis in reduce.axes if extent[axis] > 1][-1:] or [1]
    return FlatDepthPlan((packs[0], packs[1]), flat_op, depth, run[0], cycles)


@lru_cache(maxsize=1024)
def flat_depth_plan(op: Op) -> FlatDepthPlan | None:
    """The flat form of ``op`` (``flat_form``) where it pays: the depth's innermost run is
    short, the depth holds ``MIN_DEPTH_VECTORS`` vectors, the copies fit in
    ``MAX_PACK_BYTES`` and the estimate is below ``GAIN`` times that of the blocked
    kernel, the two-stage split or the loop nest, whichever the op would run as.
    Cached: the lowering and the fusion cost model both ask."""
    plan = flat_form(op)
    if plan is None:
        return None
    if plan.run >= LANES or plan.depth < MIN_DEPTH_VECTORS * LANES:
        return None
    if sum(pack.output.size for pack in plan.packs) * 4 > MAX_PACK_BYTES:
        return None
    staged = staged_plan(op)
    current = unsplit_cycles(op) if staged is None else min(staged.cycles, unsplit_cycles(op))
    return plan if plan.cycles < GAIN * current else None
