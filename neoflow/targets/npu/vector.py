"""Ops on the vector unit: element-wise ops, reductions, losses and optimizer updates as NPU programs.

An op's output points are cut into chunks that go round-robin to the vector
cores; a long reduction is cut along its (flattened) domain too, the partial
sums held in UB.  Each step MTE2 brings the GM elements the step reads (its
*footprint*: the reads' index maps evaluated over the step's points and terms)
into one half of UB, the vector unit computes into an accumulator or an output
half, MTE3 stores finished points, flags between them, halves ping-ponged.  An
op of several reductions (a loss) runs as one step over the whole of its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from neoflow.codegen.gather import unravel
from neoflow.codegen.lattice import split_epilogue
from neoflow.codegen.strided import loop_order
from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import Binary, Cast, Expr, Read, Reduce, Select, Unary
from neoflow.ir.interpreter import evaluate_at
from neoflow.ir.op import Op
from neoflow.targets.npu.data import Footprint, VectorChunk, align, read_footprint, reads_in
from neoflow.targets.npu.isa import Program, Region, copy, set_flag, vector, wait_flag
from neoflow.targets.npu.loads import FirstTouch, fetched, gm_load
from neoflow.targets.npu.machine import GM, Machine

#: bytes of a vector lane's element (the unit computes in fp32)
LANE_BYTES = 4
#: points a chunk of a reduction cut along its domain takes
SPLIT_POINTS = 64


def _has_reduce(node: Expr) -> bool:
    return isinstance(node, Reduce) or any(_has_reduce(c) for c in node.children())


def operations(node: Expr) -> int:
    """The arithmetic of ``node`` per point: its operators, calls and selections (at least one)."""
    own = 1 if isinstance(node, Binary | Unary | Cast | Select) else 0
    return max(1, own + sum(operations(c) for c in node.children() if not isinstance(c, Reduce)))


def mode(op: Op, accumulator: str | None = None) -> str:
    """How ``op`` runs on the vector unit: ``pointwise`` (no reduction), ``reduce`` (one
    reduction under an element-wise epilogue), ``epilogue`` (the reduction's value read from a
    workspace) or ``whole`` (anything else: one step over whole inputs)."""
    if accumulator is not None:
        return "epilogue"
    if op.scatter is not None:
        return "whole"
    if not _has_reduce(op.body):
        return "pointwise"
    parts = split_epilogue(op.body, op)
    if parts is not None and not _has_reduce(parts[0].body):
        return "reduce"
    return "whole"


def points_env(op: Op, points: range) -> dict:
    """The output variables' values at flat output points ``points``."""
    flat = np.arange(points.start, points.stop, dtype=np.int64)
    return unravel(flat, tuple((v, op.extent[v]) for v in op.indices))


def _terms_axis(reduce: Reduce, op: Op) -> tuple[tuple[str, int], ...]:
    """The reduction's loops (``loop_order``) with their trip counts: a strided axis takes only
    the points of its residue, one in ``modulus``."""
    return tuple(
        (axis, op.extent[axis] if stride is None else -(-op.extent[axis] // stride.modulus))
        for axis, stride in loop_order(reduce, op.extent)
    )


def grid_env(op: Op, reduce: Reduce, points: range, terms: range) -> tuple[dict, np.ndarray]:
    """The environment of every (point, term) pair of a step (points along axis 0, terms along 1)
    and which pairs lie in the reduction's domain."""
    env = {k: v[:, None] for k, v in points_env(op, points).items()}
    flat = np.arange(terms.start, terms.stop, dtype=np.int64)
    trips = unravel(flat, _terms_axis(reduce, op))
    shape = (len(points), len(terms))
    live = np.ones(shape, bool)
    for axis, stride in loop_order(reduce, op.extent):
        if stride is None:
            env[axis] = trips[axis][None, :]
            continue
        rest = np.asarray(index.evaluate(stride.rest, env), dtype=np.int64)
        value = (-stride.sign * rest) % stride.modulus + stride.modulus * trips[axis][None, :]
        live &= np.broadcast_to(value < op.extent[axis], shape)
        env[axis] = np.broadcast_to(value, shape)
    if reduce.where is not None:
        live &= np.broadcast_to(np.asarray(evaluate_at(reduce.where, env, {}, op.name, live=live)).astype(bool), shape)
    return env, live


def footprints(chunk: VectorChunk, workspace_itemsize: int = 4) -> list[Footprint]:
    """The GM elements a step reads, per tensor."""
    op = chunk.op
    kind = mode(op, chunk.accumulator)
    if kind == "whole":
        return [
            Footprint(t.name, np.arange(t.size, dtype=np.int64), dt.numpy_dtype(t.dtype).itemsize) for t in op.inputs
        ]
    at_points = points_env(op, chunk.points)
    tensors = {t.name: t for t in op.inputs}
    found: dict[str, list[np.ndarray]] = {}

    def touch(read: Read, env: dict, live: np.ndarray | None = None) -> None:
        found.setdefault(read.tensor, []).append(read_footprint(read, tensors[read.tensor], env, live).offsets)

    if kind == "reduce":
        reduce, _ = split_epilogue(op.body, op)
        env, live = grid_env(op, reduce, chunk.points, chunk.terms)
        for read, inside in reads_in(op.body):
            if inside:
                touch(read, env, live)
            elif chunk.last:
                touch(read, at_points)
    else:
        for read, inside in reads_in(op.body):
            if not inside:
                touch(read, at_points)
    sizes = {name: dt.numpy_dtype(t.dtype).itemsize for name, t in tensors.items()}
    prints = [Footprint(name, np.unique(np.concatenate(parts)), sizes[name]) for name, parts in found.items()]
    if kind == "epilogue":
        flat = np.arange(chunk.points.start, chunk.points.stop, dtype=np.int64)
        prints.append(Footprint(chunk.accumulator, flat, workspace_itemsize))
    return prints


def _plan_steps(op: Op, kind: str, slot: int) -> tuple[int, int]:
    """``(points a chunk, terms a step)`` whose bound on the bytes a step reads fits ``slot``."""
    points = op.output.size
    if kind == "whole":
        return points, 1
    reads = max(1, len(reads_in(op.body)) + (kind == "epilogue"))
    itemsize = max([dt.numpy_dtype(t.dtype).itemsize for t in op.inputs] + [LANE_BYTES])
    if kind != "reduce":
        per_point = (reads + 1) * itemsize
        return max(1, min(points, slot // per_point)), 1
    reduce, _ = split_epilogue(op.body, op)
    terms = math.prod(e for _, e in _terms_axis(reduce, op))
    sizes = [t.size for t in op.inputs]
    for chunk in (points, *(p for p in (4096, 1024, 256, SPLIT_POINTS) if p < points)):
        bound = sum(min(s, chunk * terms) for s in sizes) * itemsize + chunk * itemsize
        if bound <= slot:
            return chunk, terms
    chunk = min(points, SPLIT_POINTS)
    return chunk, max(1, (slot - chunk * itemsize) // (chunk * reads * itemsize))


#: called before a chunk's load of its workspace sums: (program, vector core, the chunk's points)
BeforeSums = Callable[[Program, int, range], None]


def emit_op(program: Program, op: Op, cores: range, accumulator: str | None = None) -> None:
    """Append the vector program of ``op`` (output GM tensor ``op.name``) over ``cores``; the
    program's first reads of each input element come from HBM (``loads``)."""
    inputs = {t.name: t.size for t in op.inputs}
    fetched(program, inputs, lambda target, touch: emit_steps(target, op, cores, accumulator, touch), len(cores))


def _slots(op: Op, machine: Machine, kind: str) -> tuple[int, int, int, int]:
    """``(points a chunk, terms a step, input slot bytes, output slot bytes)`` of ``op``'s steps in UB."""
    capacity = machine.buffer("UB").capacity
    out_itemsize = dt.numpy_dtype(op.dtype).itemsize
    slot = (capacity - 4096) // 2
    points_per_chunk, terms_per_step = _plan_steps(op, kind, slot * 3 // 4)
    out_slot = align(points_per_chunk * max(out_itemsize, LANE_BYTES), 32)
    return points_per_chunk, terms_per_step, slot - out_slot, out_slot


def chunks(op: Op, machine: Machine, accumulator: str | None = None) -> list[range]:
    """The output points of each chunk ``emit_op`` cuts ``op`` into, in order."""
    points = _slots(op, machine, mode(op, accumulator))[0]
    return [range(p, min(p + points, op.output.size)) for p in range(0, op.output.size, points)]


def emit_steps(
    program: Program,
    op: Op,
    cores: range,
    accumulator: str | None,
    touch: FirstTouch,
    order: Sequence[int] | None = None,
    before_sums: BeforeSums | None = None,
) -> None:
    """The steps of ``emit_op``, their input loads charged by ``touch``; an epilogue over the workspace
    ``accumulator`` may take its chunks (``chunks``) in ``order`` (default: as they lie), and have
    ``before_sums`` add what must come before a chunk's sums are loaded (a cross-core wait)."""
    machine: Machine = program.machine
    kind = mode(op, accumulator)
    out_itemsize = dt.numpy_dtype(op.dtype).itemsize
    _, terms_per_step, in_slot, out_slot = _slots(op, machine, kind)
    if in_slot <= 0 or (
        kind == "whole" and sum(t.size * dt.numpy_dtype(t.dtype).itemsize for t in op.inputs) > in_slot
    ):
        raise CompileError(
            f"npu: op '{op.name}' reads more than a UB half holds ({in_slot} bytes) in one step; "
            "it cannot be cut into smaller steps",
            op=op.name,
        )
    total_terms = 1
    reduce = None
    if kind == "reduce":
        reduce, _ = split_epilogue(op.body, op)
        total_terms = math.prod(e for _, e in _terms_axis(reduce, op))
    cut = chunks(op, machine, accumulator)
    if order is not None:
        cut = [cut[k] for k in order]
    per_term = operations(reduce.body) + 1 if reduce is not None else 0
    # an epilogue over a workspace reads the reduction's value: its arithmetic is what lies outside it
    tail = 1 if kind == "epilogue" and isinstance(op.body, Reduce) else operations(op.body)
    for position, core in enumerate(cores):
        mine = cut[position :: len(cores)]
        step = 0
        for count, points in enumerate(mine):
            out_half = count % 2
            out_region = Region("UB", 2 * in_slot + out_half * out_slot, max(32, len(points) * out_itemsize))
            acc_region = Region("UB", 2 * (in_slot + out_slot), align(max(32, len(points) * LANE_BYTES), 32))
            starts = range(0, total_terms, terms_per_step) if kind == "reduce" else [None]
            for start in starts:
                terms = range(start, min(start + terms_per_step, total_terms)) if start is not None else None
                first, last = start in (0, None), terms is None or terms.stop == total_terms
                chunk = VectorChunk(op, points, terms, first, last, accumulator)
                half = step % 2
                if step >= 2:
                    program.add(wait_flag(core, "VECTOR", "MTE2", half))
                offset = half * in_slot
                loaded = []
                for footprint in footprints(chunk):
                    if footprint.offsets.size == 0:
                        continue
                    if before_sums is not None and footprint.tensor == accumulator:
                        before_sums(program, core, points)
                    region = Region("UB", offset, align(footprint.bytes, 32))
                    offset += region.size
                    if offset > (half + 1) * in_slot:
                        raise CompileError(
                            f"npu: op '{op.name}': a step's inputs overflow a UB half ({in_slot} bytes)", op=op.name
                        )
                    touch.add(program, core, footprint, gm_load(machine, core, footprint, region), len(cores))
                    loaded.append(region)
                program.add(set_flag(core, "MTE2", "VECTOR", half))
                program.add(wait_flag(core, "MTE2", "VECTOR", half))
                if last and count >= 2:
                    program.add(wait_flag(core, "MTE3", "VECTOR", out_half))
                count_terms = len(terms) if terms is not None else 1
                lanes = len(points) * (count_terms * per_term + (tail if last else 0))
                repeats = math.ceil(lanes * LANE_BYTES / machine.vector.repeat_bytes)
                reads = tuple(loaded) + ((acc_region,) if kind == "reduce" and not first else ())
                writes = out_region if last else acc_region
                program.add(
                    vector(machine, core, kind, writes, *reads, repeats=repeats, data=chunk, points=len(points))
                )
                program.add(set_flag(core, "VECTOR", "MTE2", half))
                if last:
                    program.add(set_flag(core, "VECTOR", "MTE3", out_half))
                    program.add(wait_flag(core, "VECTOR", "MTE3", out_half))
                    gm = Region(GM, points.start * out_itemsize, len(points) * out_itemsize, op.name)
                    program.add(copy(machine, core, out_region, gm, moved=len(points) * out_itemsize, data=points))
                    program.add(set_flag(core, "MTE3", "VECTOR", out_half))
                step += 1
