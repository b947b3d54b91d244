"""Contractions computed in two stages: a plain matrix product, then a small gather-sum.

A contraction whose reads combine reduction and output variables in one index,
such as the input adjoint of a strided convolution
``dB[c, z] = ReduceAdd({k, r | ...}, dD[k, z//2 - r] * C[k, c, r])``, runs on the
blocked kernel only by packing an ``im2col`` copy of ``dD`` (every element once
per ``r``), and as a loop nest it re-reads ``dD`` once per ``(c, r)``.  Summing
first over the reduction variables that index both operands plainly (``k``)
gives a product whose operands are read in place,

    T[c, r, a] = ReduceAdd({k}, C[k, c, r] * dD[k, a])      (blocked kernel)
    dB[c, z]   = ReduceAdd({r | ...}, T[c, r, z//2 - r])    (loop nest, few terms)

— the same multiply-adds when ``T`` is about as large as the points the
original domain visits, and no copy.  ``staged_plan`` makes this split where
the code generator's cycle estimates say it pays and ``T`` is no larger than
the data the op moves anyway; ``lower.staged_function`` emits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import sympy

from neoflow.codegen.lattice import sum_of_product, with_reduce
from neoflow.ir import index
from neoflow.ir.expr import Binary, Read, Reduce, index_variables
from neoflow.ir.op import Op, Tensor
from neoflow.targets.cpu.gemm import GENERIC_CYCLES_PER_POINT, domain_points, gemm_plan, plan_cycles, unsplit_cycles

#: the split is taken when its estimate is below this share of the op's own
GAIN = 0.8
#: the stage's product may visit at most this many times the points of the op's domain
MAX_EXTRA_WORK = 1.25


#: partial sums ``T`` larger than the op moves are made a slice of its leading batch at a time,
#: each slice no larger than this (bytes), so that the second stage reads it from cache (a stride-1
#: capsule convolution's input adjoint, N=16: 28.8 ms in slices of 3.6 MB, 24.4 ms in 7.2 MB, 25.7 ms
#: in 14.5 MB, against 31 ms in one stage; this 2-core EPYC's L3 holds 32 MB)
SLICE_BYTES = 8 << 20
#: the second stage's cycles a point where it reads a slice of ``T`` from cache (the same adjoint's
#: second stage took a quarter of its first's time reading all of ``T`` from memory, where
#: ``GENERIC_CYCLES_PER_POINT`` predicts half)
CACHED_CYCLES_PER_POINT = 1.0


@dataclass(frozen=True)
class StagedPlan:
    """``stage`` computes the partial sums ``T`` (named ``stage.name``) from the
    op's two operands; ``rest`` computes the op's output from ``T`` (and any
    tensor the epilogue reads).  With ``batch`` set, both run one slice of ``batch``
    rows of the op's leading output variable at a time (``stage`` and ``rest`` are
    then the ops of one slice, ``sliced``), ``T`` holding one slice."""

    stage: Op
    rest: Op
    cycles: float
    batch: int | None = None


def _plain_axes(reduce: Reduce, left: Read, right: Read) -> list[str]:
    """Reduction axes that are a whole index of each operand, appear in no other
    index of either and not in the domain condition: summing over them first
    leaves a matrix product of the operands read in place."""
    guarded = set() if reduce.where is None else index_variables(reduce.where)

    def plain(axis: str) -> bool:
        symbol = index.var(axis)
        return all([e for e in read.indices if symbol in e.free_symbols] == [symbol] for read in (left, right))

    return [axis for axis in reduce.axes if axis not in guarded and plain(axis)]


def split_contraction(op: Op) -> tuple[Op, Op] | None:
    """``(stage, rest)`` for a float32 op whose body is a sum of ``x * y`` (under an
    optional epilogue) with both plain and combined reduction axes; None otherwise.
    ``T``'s dimensions are the operands' other indices, an index both operands
    share (a batch variable) counted once."""
    parts = sum_of_product(op)
    if parts is None:
        return None
    reduce, epilogue, left, right = parts
    if left.tensor == right.tensor:
        return None
    tensors = {t.name: t for t in op.inputs}
    if tensors[left.tensor].dtype != "float32" or tensors[right.tensor].dtype != "float32":
        return None
    plain = _plain_axes(reduce, left, right)
    combined = [axis for axis in reduce.axes if axis not in plain]
    if not plain or not combined:
        return None
    plain_symbols = {index.var(axis) for axis in plain}
    extent = op.extent
    taken = set(extent)
    dims: dict[sympy.Expr, tuple[str, int]] = {}  # index expression -> (T variable, extent)
    # the operand indexed by the output's innermost variable goes last in ``T``, so that
    # the second stage reads ``T`` along that variable contiguously
    innermost = index.var(op.indices[-1]) if op.indices else None
    ordered = sorted((left, right), key=lambda read: any(innermost in e.free_symbols for e in read.indices))
    for read in ordered:
        for expr, size in zip(read.indices, tensors[read.tensor].shape, strict=True):
            if expr in plain_symbols:
                continue
            if expr in dims:
                dims[expr] = (dims[expr][0], min(dims[expr][1], size))
                continue
            name = f"t{len(dims)}_"
            while name in taken:
                name += "_"
            taken.add(name)
            dims[expr] = (name, size)
    variables = {expr: index.var(name) for expr, (name, _) in dims.items()}

    def staged_read(read: Read) -> Read:
        return Read(
            read.tensor, tuple(e if e in plain_symbols else variables[e] for e in read.indices), read.tensor_dtype
        )

    partial = Tensor(f"{op.name}_staged", tuple(size for _, size in dims.values()), "float32")
    stage_inputs = tuple(tensors[name] for name in dict.fromkeys([left.tensor, right.tensor]))
    stage = Op(
        partial,
        tuple(name for name, _ in dims.values()),
        Reduce(
            "ReduceAdd",
            tuple(plain),
            tuple(extent[a] for a in plain),
            Binary("*", staged_read(left), staged_read(right)),
        ),
        stage_inputs,
        (*((name, size) for name, size in dims.values()), *((a, extent[a]) for a in plain)),
    )
    gathered = Reduce(
        "ReduceAdd",
        tuple(combined),
        tuple(extent[a] for a in combined),
        Read(partial.name, tuple(dims), "float32"),
        reduce.where,
    )
    body = with_reduce(epilogue, gathered)
    read_names = [n.tensor for n in body.walk() if isinstance(n, Read)]
    all_tensors = {**tensors, partial.name: partial}
    rest = Op(
        op.output,
        op.indices,
        body,
        tuple(all_tensors[name] for name in dict.fromkeys(read_names)),
        tuple((v, size) for v, size in op.ranges if v not in plain),
    )
    return stage, rest


@lru_cache(maxsize=1024)
def staged_plan(op: Op) -> StagedPlan | None:
    """The two-stage form of ``op`` when it pays: the stage runs on the blocked
    kernel, visits at most ``MAX_EXTRA_WORK`` times the op's domain points, its
    partial sums take no more memory than the op's operands and output (or else
    run a slice of the leading batch at a time, ``SLICE_BYTES`` of them at most),
    and the two stages' estimated cycles are below ``GAIN`` times the op's.
    Cached: the lowering and the fusion cost model both ask."""
    split = split_contraction(op)
    if split is None:
        return None
    stage, rest = split
    stage_plan = gemm_plan(stage)
    if stage_plan is None:
        return None
    points = domain_points(op)
    if math.prod(stage.extent.values()) > MAX_EXTRA_WORK * points:
        return None
    moved = op.output.size + sum(t.size for t in op.inputs)
    batch = None
    if stage.output.size > moved:
        batch = _slice_rows(op, stage, rest)
        if batch is None:
            return None
    per_point = GENERIC_CYCLES_PER_POINT if batch is None else CACHED_CYCLES_PER_POINT
    cycles = plan_cycles(stage_plan) + per_point * domain_points(rest)
    if cycles >= GAIN * unsplit_cycles(op):
        return None
    if batch is None:
        return StagedPlan(stage, rest, cycles)
    return StagedPlan(sliced(stage, batch), sliced(rest, batch), cycles, batch)


def _slice_rows(op: Op, stage: Op, rest: Op) -> int | None:
    """Rows of the op's leading output variable a slice takes where both stages can run slice by
    slice (``sliced`` applies to each) and one slice of ``T`` is at most ``SLICE_BYTES``; else None."""
    rows = op.extent[op.indices[0]] if op.indices else 1
    leading = index.var(op.indices[0]) if op.indices else None
    # the second stage reads T with the op's leading variable leading, so T's first dimension is it
    reads = [n for n in rest.body.walk() if isinstance(n, Read) and n.tensor == stage.name]
    if rows < 2 or stage.output.shape[0] != rows or any(r.indices[0] != leading for r in reads):
        return None
    if _cut_tensors(stage) is None or _cut_tensors(rest) is None:
        return None
    per_row = stage.output.size // rows * 4
    fitting = [d for d in range(1, rows) if rows % d == 0 and d * per_row <= SLICE_BYTES]
    return max(fitting) if fitting else None


def _cut_tensors(op: Op) -> set[str] | None:
    """The input tensors ``sliced`` cuts: those ``op``'s leading output variable indexes, where it is
    the whole first index of every read of them and of nothing else, and no condition mentions it;
    None where it is not so."""
    if not op.indices or op.scatter is not None:
        return None
    leading = op.indices[0]
    symbol = index.var(leading)
    reads: list[Read] = []
    for node in op.body.walk():
        if isinstance(node, Reduce) and node.where is not None and leading in index_variables(node.where):
            return None
        if isinstance(node, Read):
            reads.append(node)
    cut = {read.tensor for read in reads if any(symbol in e.free_symbols for e in read.indices)}
    for read in reads:
        if read.tensor in cut and (
            read.indices[0] != symbol or any(symbol in e.free_symbols for e in read.indices[1:])
        ):
            return None
    return cut


def sliced(op: Op, rows: int) -> Op | None:
    """``op`` over ``rows`` values of its leading output variable, the tensors that variable
    indexes cut to as many rows (``_cut_tensors``); None where they cannot be.  Run at each slice's
    first row (pointers moved there), it computes that slice of ``op``."""
    cut = _cut_tensors(op)
    if cut is None:
        return None
    leading = op.indices[0]

    def fewer(tensor: Tensor) -> Tensor:
        return Tensor(tensor.name, (rows, *tensor.shape[1:]), tensor.dtype)

    return Op(
        fewer(op.output),
        op.indices,
        op.body,
        tuple(fewer(t) if t.name in cut else t for t in op.inputs),
        tuple((v, rows if v == leading else size) for v, size in op.ranges),
    )
