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
at the same point (it was stored there a statement before).  A member of
another shape joins too when it reads earlier members only through one index
map that is a bijection between its points (and terms of its sum) and a part
of the main domain — the gradient of a depth-to-space reads the gradient of
its output that way: islpy proves the bijection and inverts it, and the
member is computed at the main point and *written through* the inverse
(``Nest.writes``).  Any other read of a member is not a nest.  The statements of all members share one isl schedule
(the main indices, then the member, then its own statement order), so isl
prints one loop nest; its outer loops are shared out among threads and its
inner loops run in vector lanes (``#pragma omp simd``: members carry no
dependence between points, the sums are reductions).  Where every member is
point-wise over one shape whose innermost extent is short (an optimizer's
updates of a conv weight), the nest runs over that shape's trailing dimensions
merged (``neoflow.codegen.merged``); its arguments keep the graph's shapes.

An element-wise member nothing outside the nest reads (``private``: an
intermediate the fusion plan keeps in a tile buffer) is not stored at all: it
is written into a *row buffer* of the main domain's innermost extent, private
to each thread, and its readers in the nest read it there (they read members
only at the main point, and each member's inner loop runs whole inside the
shared outer loops, so the row holds the current point's values).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import islpy as isl
import sympy

from neoflow.codegen.c_expr import c_type
from neoflow.codegen.inner_split import Written, split_inner
from neoflow.codegen.lattice import split_epilogue
from neoflow.codegen.merged import merged_group
from neoflow.ir import bounds, index
from neoflow.ir import dtypes as dt
from neoflow.ir.expr import Const, Expr, Index, Read, Reduce, Select, map_children, map_indices
from neoflow.ir.op import Op, Tensor
from neoflow.targets.cpu.lower import (
    PREFIX,
    SHORT_SUM_LOOP,
    Lowering,
    _Scope,
    collapsible,
    isl_loops,
    loop_pair,
    most_trips,
    statement_macros,
    with_pragmas,
)
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS


@dataclass(frozen=True)
class Nest:
    """Ops computed in one loop nest: ``members`` renamed onto the main
    domain (``indices`` with ``extents``), in the given order; for a sum member,
    ``sums`` holds its per-point term as an element-wise op and its epilogue
    (the member's body, printed with the sum's value for the reduction);
    ``inputs`` are the tensors read from outside, in first-read order, and
    ``outputs`` the members' output tensors.  A member written through an
    index map has an entry in ``writes``: where in its output each main point
    goes (index expressions in the main indices) and the isl constraint of the
    main points it is computed at.  ``buffered`` members are kept in a row buffer
    instead of being stored (they are not among ``outputs``)."""

    indices: tuple[str, ...]
    extents: tuple[int, ...]
    members: tuple[Op, ...]
    sums: Mapping[str, Expr]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    writes: Mapping[str, Written] = field(default_factory=dict)
    buffered: tuple[str, ...] = ()


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


def shared_nest(ops: Sequence[Op], private: Collection[str] = ()) -> Nest | None:
    """The loop nest computing ``ops`` together (see the module docstring), or
    None when they are fewer than two or are not all members of one.  Of the
    ``private`` ops (read by nothing outside ``ops``), the element-wise members
    are kept in row buffers where the main domain allows (``row_buffered``)."""
    if len(ops) < 2:
        return None
    tensors = {t.name: t for op in ops for t in (op.output, *op.inputs)}  # as the graph shapes them
    ops = merged_group(ops) or ops
    main = max((op for op in ops if op.shape), key=lambda op: math.prod(op.shape), default=None)
    if main is None:
        return None
    indices, extents = main.indices, main.shape
    members: list[Op] = []
    sums: dict[str, Expr] = {}
    writes: dict[str, Written] = {}
    stored: set[str] = set()  # element-wise members already computed
    produced = {op.name for op in ops}
    point = tuple(index.var(v) for v in indices)
    for op in ops:
        found = _as_member(op, indices, extents)
        if found is None:
            mapped = _written_through(op, stored, indices, extents)
            if mapped is None:
                return None
            member, written = mapped
            members.append(member)
            writes[op.name] = written
            continue
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
    elementwise = [member.name for member in members if member.name in stored]
    buffered = row_buffered(private, elementwise, extents, {op.name: op.dtype for op in ops})
    if buffered:  # each buffered member is written into its row at the main point's innermost index
        members = [_on_rows(member, buffered, indices, extents) for member in members]
        box = bounds.box_constraint(dict(zip(indices, extents, strict=True)))
        writes.update({name: Written((index.var(indices[-1]),), (), box) for name in buffered})
    outputs = tuple(tensors[op.name] for op in ops if op.name not in buffered)
    inputs_read = tuple(tensors[name] for name in inputs)
    return Nest(indices, extents, tuple(members), sums, inputs_read, outputs, writes, tuple(buffered))


def nest_buffers(ops: Sequence[Op], private: Collection[str] = ()) -> tuple[str, ...] | None:
    """The ``private`` ops that the loop nest of ``ops`` keeps in row buffers,
    or None when ``ops`` make no loop nest (the fusion cost model's question)."""
    nest = shared_nest(ops, private)
    return None if nest is None else nest.buffered


#: The most bytes a row buffer may take (one per buffered member and thread, on the thread's stack).
ROW_BUFFER_BYTES = 16 * 1024


def row_buffered(
    private: Collection[str], elementwise: Collection[str], extents: tuple[int, ...], dtypes: Mapping[str, str]
) -> list[str]:
    """The ``private`` ops among the ``elementwise`` members that a nest over
    ``extents`` keeps in row buffers: there must be outer loops around the
    members' inner loops (some outer extent above 1) and a row must be small."""
    if len(extents) < 2 or math.prod(extents[:-1]) < 2:
        return []
    return [
        name
        for name in elementwise
        if name in private and extents[-1] * dt.numpy_dtype(dtypes[name]).itemsize <= ROW_BUFFER_BYTES
    ]


def _on_rows(member: Op, buffered: Collection[str], indices: tuple[str, ...], extents: tuple[int, ...]) -> Op:
    """``member`` reading the ``buffered`` members from their rows (at the main
    point's innermost index); a buffered member's own output is its row."""
    rows = {name: (extents[-1],) for name in buffered}
    inner = index.var(indices[-1])

    def from_rows(node: Expr) -> Expr:
        if isinstance(node, Read) and node.tensor in rows:
            return Read(node.tensor, (inner,), node.tensor_dtype)
        if isinstance(node, (Read, Index)):
            return node
        return map_children(node, from_rows)

    inputs = tuple(Tensor(t.name, rows[t.name], t.dtype) if t.name in rows else t for t in member.inputs)
    member = replace(member, body=from_rows(member.body), inputs=inputs)
    if member.name in rows:
        member = replace(member, output=Tensor(member.name, rows[member.name], member.dtype))
    return member


def _written_through(
    op: Op, stored: set[str], indices: tuple[str, ...], extents: tuple[int, ...]
) -> tuple[Op, Written] | None:
    """``op`` computed at the main points it maps to, when it reads the members
    in ``stored`` through one index map that pairs each of its points (and term
    of its sum: ``ReduceAdd`` whose condition leaves one term per point) with
    one main point: ``(member on the main domain, where it is written)``; else None."""
    if op.scatter is not None or not op.dtype.startswith("float") or not op.shape:
        return None
    term, axes, where = op.body, (), None
    if isinstance(term, Reduce):
        if term.kind != "ReduceAdd" or term.dtype != op.dtype:
            return None
        term, axes, where = term.body, term.axes, term.where
    if not _reduce_free(term) or (where is not None and not _reduce_free(where)):
        return None
    member_reads = {node.indices for node in term.walk() if isinstance(node, Read) and node.tensor in stored}
    if len(member_reads) != 1 or any(isinstance(n, Read) and n.tensor == op.name for n in term.walk()):
        return None
    (via,) = member_reads
    # the op's variables renamed clear of the main indices (both sides share isl's name prefix)
    taken = set(indices)
    names = {v: index.fresh_name(f"{v}_w", taken) for v in (*op.indices, *axes)}
    renamed = {index.var(v): index.var(new) for v, new in names.items()}
    via = tuple(e.xreplace(renamed) for e in via)
    condition = None
    if where is not None:
        condition = bounds.condition_to_isl(map_indices(where, lambda e: e.xreplace(renamed)))
        if condition is None:
            return None
    relation = _relation(op, names, via, indices, condition)
    if relation is None:
        return None
    inverse = _inverse(relation[0], names, indices)
    if inverse is None:
        return None
    point = tuple(index.var(v) for v in indices)
    substitution = {index.var(v): inverse[new] for v, new in names.items()}

    def at_main_point(node: Expr) -> Expr:
        if isinstance(node, Read) and node.tensor in stored:
            return Read(node.tensor, point, node.tensor_dtype)
        if isinstance(node, (Read, Index)):
            return map_indices(node, lambda e: e.xreplace(substitution))
        return map_children(node, at_main_point)

    body = at_main_point(term)
    member = replace(
        op,
        body=body,
        indices=indices,
        ranges=tuple(zip(indices, extents, strict=True)),
        range_sources=(),
        inputs=tuple(t for t in op.inputs if any(isinstance(n, Read) and n.tensor == t.name for n in body.walk())),
    )
    target = tuple(inverse[names[v]] for v in op.indices)
    return member, Written(target, tuple(names.values()), relation[1])


def _relation(
    op: Op, names: Mapping[str, str], via: tuple[sympy.Expr, ...], indices: tuple[str, ...], condition: str | None
) -> tuple[isl.Map, str] | None:
    """The map from op's points and sum terms to the main points they read
    (and its constraint text), when it is a bijection from all of op's points
    onto part of the main domain; else None."""
    targets = [index.to_isl(e, PREFIX) for e in via]
    if len(targets) != len(indices) or None in targets:
        return None
    box = bounds.box_constraint({new: op.extent[v] for v, new in names.items()})
    parts = [
        box,
        *([condition] if condition else []),
        *(f"{PREFIX}{v} = {t}" for v, t in zip(indices, targets, strict=True)),
    ]
    constraint = " and ".join(f"({p})" for p in parts)
    sources = ", ".join(PREFIX + new for new in names.values())
    relation = isl.Map(f"{{ [{sources}] -> [{', '.join(PREFIX + v for v in indices)}] : {constraint} }}")
    points = relation.project_out(isl.dim_type.in_, len(op.indices), len(names) - len(op.indices))
    every_point = bounds.make_set(
        [names[v] for v in op.indices], bounds.box_constraint({names[v]: op.extent[v] for v in op.indices})
    )
    if not (relation.is_injective() and points.is_single_valued() and points.domain().is_equal(every_point)):
        return None
    return relation, constraint


def _inverse(forward: isl.Map, names: Mapping[str, str], indices: tuple[str, ...]) -> dict[str, sympy.Expr] | None:
    """Each of op's (renamed) variables ``names`` as an index expression in the
    main ``indices``, from isl's inverse of ``forward``; None where isl needs pieces."""
    inverse = isl.PwMultiAff.from_map(forward.reverse())
    build = isl.AstBuild.from_context(forward.range())
    symbols = {PREFIX + v: index.var(v) for v in indices}
    found = {}
    for k, new in enumerate(names.values()):
        if inverse.get_pw_aff(k).n_piece() != 1:
            return None
        expr = _from_ast(build.expr_from_pw_aff(inverse.get_pw_aff(k)), symbols)
        if expr is None:
            return None
        found[new] = expr
    return found


def _from_ast(expr: isl.AstExpr, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr | None:
    """An isl AST expression (integer arithmetic, floor division, remainder) as a
    sympy index expression; None for anything else (a min, a choice)."""
    kind = expr.get_type()
    if kind == isl.ast_expr_type.int:
        return sympy.Integer(int(expr.get_val().to_python()))
    if kind == isl.ast_expr_type.id:
        return symbols.get(expr.get_id().get_name())
    if kind != isl.ast_expr_type.op:
        return None
    args = [_from_ast(expr.get_op_arg(k), symbols) for k in range(expr.get_op_n_arg())]
    if any(a is None for a in args):
        return None
    ops = isl.ast_expr_op_type
    which = expr.get_op_type()
    if which == ops.add:
        return args[0] + args[1]
    if which == ops.sub:
        return args[0] - args[1]
    if which == ops.mul:
        return args[0] * args[1]
    if which == ops.minus:
        return -args[0]
    if which in (ops.div, ops.fdiv_q, ops.pdiv_q):
        return index.floordiv(args[0], args[1])
    if which == ops.pdiv_r:
        return index.mod(args[0], args[1])
    return None


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
    buffers.update({t.name: f"out{k}" for k, t in enumerate(nest.outputs)})
    rows = {name: f"row{k}" for k, name in enumerate(nest.buffered)}
    buffers.update(rows)
    statements, totals, finals = [], [], []
    for k, member in enumerate(nest.members):
        if member.name in nest.sums:
            total = f"sum{k}"
            lowering: Lowering = _SumLowering(member, buffers, f"m{k}_", total)
            totals.append((c_type(member.dtype), total))
        else:  # stored at its point, through a map or into its row; the depth-to-space family split
            written = nest.writes.get(member.name)
            member, written = split_inner(member, written) or (member, written)
            lowering = Lowering(member, buffers, f"m{k}_", written)
        lowering.build()
        inner = len(nest.indices) - 1
        for statement in lowering.statements:
            # the member's own loop over the innermost index, after the earlier members' loops
            schedule = [*statement.schedule[:inner], str(k), *statement.schedule[inner:]]
            statements.append(replace(statement, schedule=schedule))
        if member.name in nest.sums:
            finals.append(f"    {buffers[member.name]}[0] = {_epilogue(lowering, nest.sums[member.name], total)};")
    lines = [*statement_macros(statements), f"void {name}({nest_parameters(nest)}) {{"]
    lines += [f"    {ctype} {total} = 0;" for ctype, total in totals]
    dtypes = {member.name: member.dtype for member in nest.members}
    lines += [f"    {c_type(dtypes[member])} {row}[{nest.extents[-1]}];" for member, row in rows.items()]
    parallel = math.prod(nest.extents) >= PARALLEL_MIN_POINTS
    lines += _annotated(isl_loops(statements, separate=True), [t for _, t in totals], list(rows.values()), parallel)
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


def _annotated(loops: str, totals: Sequence[str], private: Sequence[str], parallel: bool) -> list[str]:
    """isl's loops with OpenMP: outermost loops shared out among threads (a short
    one collapsed with the loop it holds; the sums ``totals`` reduced, each
    thread with its own copy of the ``private`` row buffers), and a loop adding
    to one sum alone split into vector lanes.  Other inner loops are left to the
    compiler's own vectoriser."""
    clauses = f" reduction(+:{', '.join(totals)})" if totals else ""
    clauses += f" private({', '.join(private)})" if private else ""
    collapsed: set[int] = set()  # the lines of loops collapsed into the one around them

    def pragmas(rows: Sequence[str], number: int, outermost: bool) -> list[str]:
        text, following = loop_pair(rows, number)
        indent = len(rows[number]) - len(text)
        if parallel and outermost:
            if collapsible(text, following) and _summed(rows, number + 1, indent + 2, totals) is None:
                collapsed.add(number + 1)
                return [f"parallel for collapse(2){clauses}"]
            return [f"parallel for{clauses}"]
        summed = _summed(rows, number, indent, totals)
        vector = summed is not None and number not in collapsed and most_trips(text) >= SHORT_SUM_LOOP
        return [f"simd reduction(+:{summed})"] if vector else []

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
