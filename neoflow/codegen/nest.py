"""Several ops of one kernel in one loop nest: a multi-output kernel.

A fusion plan may put ops that read the same tensors in one kernel — the
forward output ``F``, the loss summed over it and the loss's gradient
``grad_F``, or an optimizer's moment and parameter updates.  Run one after
another, each op reads its inputs again; in one loop nest over their common
domain every input element is loaded once for all of them.

Members (``shared_nest``) are element-wise ops over the *main* domain (same
shape, no reduction in their bodies; their index variables renamed to the
main op's) and *sums over it*: ``out[] = f(ReduceAdd({axes over exactly that
box}, term))``, whose term is added to a scalar per point and ``f`` applied
after the loops.  A member may read an earlier element-wise member's output
at the same point (it was stored there a statement before); any other read of
a member is not a nest.  The statements of all members share one isl schedule
(the main indices, then the member, then its own statement order), so isl
prints one loop nest; its outer loops are shared out among threads and its
inner loops run in vector lanes (``#pragma omp simd``: members carry no
dependence between points, the sums are reductions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from neoflow.codegen.c_expr import PARALLEL_MIN_POINTS, c_type
from neoflow.codegen.lattice import split_epilogue
from neoflow.codegen.lower import Lowering, _Scope, collapsible, isl_loops, loop_pair, statement_macros, with_pragmas
from neoflow.ir import index
from neoflow.ir.expr import Const, Expr, Read, Reduce, Select, map_indices
from neoflow.ir.op import Op, Tensor


@dataclass(frozen=True)
class Nest:
    """Ops computed in one loop nest: ``members`` renamed onto the main
    domain (``indices`` with ``extents``), in the given order; for a sum member,
    ``sums`` holds its per-point term as an element-wise op and its epilogue
    (the member's body, printed with the sum's value for the reduction);
    ``inputs`` are the tensors read from outside, in first-read order, and
    ``outputs`` the members' output tensors."""

    indices: tuple[str, ...]
    extents: tuple[int, ...]
    members: tuple[Op, ...]
    sums: Mapping[str, Expr]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def _reduce_free(node: Expr) -> bool:
    return not any(isinstance(n, Reduce) for n in node.walk())


def _renamed(op: Op, names: Mapping[str, str], indices: tuple[str, ...], extents: tuple[int, ...]) -> Op:
    """``op``'s body with its variables renamed by ``names``, over ``indices``."""
    symbols = {index.var(old): index.var(new) for old, new in names.items()}
    body = map_indices(op.body, lambda e: e.xreplace(symbols))
    return replace(op, body=body, indices=indices, ranges=tuple(zip(indices, extents, strict=True)), range_sources=())


def _as_member(op: Op, indices: tuple[str, ...], extents: tuple[int, ...]) -> tuple[Op, Expr | None] | None:
    """``op`` on the main domain, with its epilogue when it is a sum over it; None when it is neither."""
    if op.scatter is not None or not op.dtype.startswith("float"):
        return None
    if op.shape == extents and _reduce_free(op.body):
        return _renamed(op, dict(zip(op.indices, indices, strict=True)), indices, extents), None
    split = split_epilogue(op.body, op) if op.shape == () else None
    if split is None:
        return None
    reduce, epilogue = split
    axis_extents = tuple(op.extent[a] for a in reduce.axes)
    if (
        reduce.kind != "ReduceAdd"
        or not reduce.dtype.startswith("float")
        or axis_extents != extents
        or not _reduce_free(reduce.body)
        or (reduce.where is not None and not _reduce_free(reduce.where))
        or (epilogue is not None and any(isinstance(n, Read) and n not in reduce.walk() for n in epilogue.walk()))
    ):
        return None
    term = reduce.body if reduce.where is None else Select(reduce.where, reduce.body, Const(0.0))
    partial = replace(op, output=Tensor(op.name, extents, reduce.dtype), body=term, indices=reduce.axes)
    partial = replace(partial, ranges=tuple(zip(reduce.axes, extents, strict=True)))
    renamed = _renamed(partial, dict(zip(reduce.axes, indices, strict=True)), indices, extents)
    return renamed, (epilogue if epilogue is not None else reduce)


def shared_nest(ops: Sequence[Op]) -> Nest | None:
    """The loop nest computing ``ops`` together (see the module docstring), or
    None when they are fewer than two or are not all members of one."""
    if len(ops) < 2:
        return None
    main = max((op for op in ops if op.shape), key=lambda op: math.prod(op.shape), default=None)
    if main is None:
        return None
    indices, extents = main.indices, main.shape
    members: list[Op] = []
    sums: dict[str, Expr] = {}
    stored: set[str] = set()  # element-wise members already computed
    produced = {op.name for op in ops}
    point = tuple(index.var(v) for v in indices)
    for op in ops:
        found = _as_member(op, indices, extents)
        if found is None:
            return None
        member, epilogue = found
        for node in member.body.walk():
            member_read = isinstance(node, Read) and node.tensor in produced
            if member_read and (node.tensor not in stored or tuple(node.indices) != point):
                return None
        members.append(member)
        if epilogue is None:
            stored.add(op.name)
        else:
            sums[op.name] = epilogue
    inputs: dict[str, Tensor] = {}
    for member in members:
        for tensor in member.inputs:
            if tensor.name not in produced:
                inputs.setdefault(tensor.name, tensor)
    if not inputs:
        return None
    outputs = tuple(op.output for op in ops)
    return Nest(indices, extents, tuple(members), sums, tuple(inputs.values()), outputs)


class _SumLowering(Lowering):
    """A sum member's per-point term, added to the scalar ``total`` instead of stored."""

    def __init__(self, op: Op, buffers: Mapping[str, str], tag: str, total: str) -> None:
        super().__init__(op, buffers, tag)
        self.total = total

    def _store(self, scope: _Scope, body: Expr) -> None:
        self._scope = scope
        value = self.values(body, self.op.dtype)
        self._add(scope, scope.variables, f"{self.total} = {self.total} + {value};")


def nest_parameters(nest: Nest) -> str:
    """The C parameters of a nest's function: ``out<k>`` per member, then ``in<k>`` per input."""
    outs = [f"{c_type(t.dtype)} *restrict out{k}" for k, t in enumerate(nest.outputs)]
    ins = [f"const {c_type(t.dtype)} *restrict in{k}" for k, t in enumerate(nest.inputs)]
    return ", ".join([*outs, *ins])


def nest_function(nest: Nest, name: str) -> str:
    """The C function ``name(out0, ..., in0, ...)`` computing every member of ``nest``."""
    buffers = {t.name: f"in{k}" for k, t in enumerate(nest.inputs)}
    buffers.update({op.name: f"out{k}" for k, op in enumerate(nest.members)})
    statements, totals, finals = [], [], []
    for k, member in enumerate(nest.members):
        if member.name in nest.sums:
            total = f"sum{k}"
            lowering: Lowering = _SumLowering(member, buffers, f"m{k}_", total)
            totals.append((c_type(member.dtype), total))
        else:
            lowering = Lowering(member, buffers, f"m{k}_")
        lowering.build()
        inner = len(nest.indices) - 1
        for statement in lowering.statements:
            # the member's own loop over the innermost index, after the earlier members' loops
            schedule = [*statement.schedule[:inner], str(k), *statement.schedule[inner:]]
            statements.append(replace(statement, schedule=schedule))
        if member.name in nest.sums:
            finals.append(f"    out{k}[0] = {_epilogue(lowering, nest.sums[member.name], total)};")
    lines = [*statement_macros(statements), f"void {name}({nest_parameters(nest)}) {{"]
    lines += [f"    {ctype} {total} = 0;" for ctype, total in totals]
    parallel = math.prod(nest.extents) >= PARALLEL_MIN_POINTS
    lines += _annotated(isl_loops(statements, separate=True), [t for _, t in totals], parallel)
    lines += finals
    lines.append("}")
    return "\n".join([*lines, *(f"#undef {s.name}" for s in statements)])


def _epilogue(lowering: Lowering, epilogue: Expr, total: str) -> str:
    """The sum member's value: its epilogue with the sum's total for the reduction."""
    printer = lowering.values
    saved = printer.reduction
    printer.reduction = lambda node: total
    try:
        return printer(epilogue, lowering.op.dtype)
    finally:
        printer.reduction = saved


def _annotated(loops: str, totals: Sequence[str], parallel: bool) -> list[str]:
    """isl's loops with OpenMP: outermost loops shared out among threads (a short
    one collapsed with the loop it holds; the sums ``totals`` reduced), and a loop
    adding to one sum alone split into vector lanes.  Other inner loops are left
    to the compiler's own vectoriser."""
    reduction = f" reduction(+:{', '.join(totals)})" if totals else ""
    collapsed: set[int] = set()  # the lines of loops collapsed into the one around them

    def pragmas(rows: Sequence[str], number: int, outermost: bool) -> list[str]:
        text, following = loop_pair(rows, number)
        indent = len(rows[number]) - len(text)
        if parallel and outermost:
            if collapsible(text, following) and _summed(rows, number + 1, indent + 2, totals) is None:
                collapsed.add(number + 1)
                return [f"parallel for collapse(2){reduction}"]
            return [f"parallel for{reduction}"]
        summed = _summed(rows, number, indent, totals)
        return [f"simd reduction(+:{summed})"] if summed is not None and number not in collapsed else []

    return with_pragmas(loops, pragmas)


def _summed(rows: Sequence[str], number: int, indent: int, totals: Sequence[str]) -> str | None:
    """The sum (``sum<k>``, one of ``totals``) that the loop on line ``number`` adds
    to, when it holds no other loop and only statements of that sum's member (``Sm<k>_``)."""
    tags = set()
    for line in rows[number + 1 :]:
        text = line.lstrip()
        if len(line) - len(text) <= indent:
            break
        if text.startswith("for (int "):
            return None
        if text.startswith("Sm"):
            tags.add(text[2:].split("_", 1)[0])
    total = f"sum{tags.pop()}" if len(tags) == 1 else None
    return total if total in totals else None
