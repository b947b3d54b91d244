"""Lattice domains split into dense pieces by a change of variables.

Autodiff gives the input adjoint of a strided op a reduction domain with a
lattice condition, e.g. ``dX[z] = ReduceAdd({r | (z - r) % 2 == 0 && ...}, ...)``:
only one point in ``m`` of the box contributes.  Substituting ``z = 2*z' + φ``
and ``r = 2*r' + ρ`` for each residue ``φ`` of the output variable (and the
one residue ``ρ`` of the reduction variable the condition then allows) turns
the condition into a constant and every ``(z - r) // 2`` into the affine
``z' - r' + c``: ``m`` dense pieces, each a contraction over its own smaller
box that writes a strided slice of the output (stride ``m * stride(z)``,
offset ``φ * stride(z)``).  A piece whose condition is false everywhere has an
empty reduction: its slice of the output is zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import islpy as isl
import sympy

from neoflow.ir import bounds, index
from neoflow.ir.bounds import lattice_condition
from neoflow.ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Read,
    Reduce,
    Select,
    conjuncts,
    map_children,
    map_indices,
    reductions,
)
from neoflow.ir.op import Op, Tensor
from neoflow.ir.simplify import condition_value

MAX_PIECES = 64
#: the most residues of a reduction variable tried (one of them is kept)
MAX_RESIDUES = 256


@dataclass(frozen=True)
class Piece:
    """A dense part of an op's domain: ``op`` over its own variables, writing
    output element ``base + Σ strides[v] * v`` of the original output; ``empty``
    when its reduction has no points and its slice is zero (where an epilogue
    makes an empty sum's value other than zero, the piece's ``op`` is that
    epilogue of a zero sum, an element-wise op, and not ``empty``)."""

    op: Op
    strides: dict[str, int] = field(hash=False)
    base: int
    empty: bool = False


def piece_target(piece: Piece, shape: Sequence[int]) -> tuple[sympy.Expr, ...] | None:
    """Where each point of ``piece`` goes in the whole output of ``shape``: one index
    expression per dimension in the piece's variables (``2*h_ + 1`` for the odd rows),
    each variable on the outermost dimension whose size divides its stride; None when
    the piece's last point would then run past a dimension (a stride that is no
    multiple of a dimension's size but longer than it, a base too near the end)."""
    dims = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    target: list[sympy.Expr] = []
    rest = piece.base
    for stride in dims:
        target.append(sympy.Integer(rest // stride))
        rest %= stride
    for v, stride in piece.strides.items():
        d = next(d for d, size in enumerate(dims) if stride % size == 0)  # the innermost size is 1
        target[d] += stride // dims[d] * index.var(v)
    extent = piece.op.extent
    for d, expr in enumerate(target):
        last = expr.subs({index.var(v): extent[v] - 1 for v in piece.strides})
        if not 0 <= int(last) < shape[d]:
            return None
    return tuple(target)


def split_epilogue(body: Expr, op: Op | None = None) -> tuple[Reduce, Expr | None] | None:
    """``(reduce, epilogue)`` for a body that is one reduction, or an expression
    holding exactly one reduction and no other: ``epilogue`` is the whole
    body, applied to the reduction's value at each output point (``relu(acc +
    bias)``), None when the body is the reduction alone.  A reduction under a
    ``Select`` branch is computed at every output point, so it is taken only
    when ``op`` (the op of ``body``) is given and the reduction's reads stay in
    bounds everywhere in its box."""
    if isinstance(body, Reduce):
        return body, None
    found: list[tuple[Reduce, bool]] = []

    def visit(node: Expr, guarded: bool) -> None:
        if isinstance(node, Reduce):
            found.append((node, guarded))
            return
        if isinstance(node, Select):
            visit(node.cond, guarded)
            visit(node.a, True)
            visit(node.b, True)
        elif isinstance(node, Binary) and node.op in ("&&", "||"):
            visit(node.a, guarded)
            visit(node.b, True)
        else:
            for child in node.children():
                visit(child, guarded)

    visit(body, False)
    if len(found) != 1:
        return None
    reduce, guarded = found[0]
    if guarded and (op is None or not _reads_in_bounds(reduce, op)):
        return None
    return reduce, body


def _zero(node: Expr) -> bool:
    """Whether ``node`` is zero whatever its reads hold (``Select(c, 0, 0)``, ``x * 0``)."""
    if isinstance(node, Const):
        return node.value == 0
    if isinstance(node, Cast):
        return _zero(node.x)
    if isinstance(node, Select):
        return _zero(node.a) and _zero(node.b)
    if isinstance(node, Binary) and node.op == "*":
        return _zero(node.a) or _zero(node.b)
    if isinstance(node, Binary) and node.op in ("+", "-"):
        return _zero(node.a) and _zero(node.b)
    return False


@lru_cache(maxsize=4096)
def _reads_in_bounds(reduce: Reduce, op: Op) -> bool:
    shapes = {t.name: t.shape for t in op.inputs}
    try:
        return bounds.first_violation(bounds.accesses(reduce), op.extent, shapes) is None
    except isl.Error:  # a condition isl cannot read: do not assume the reads are safe
        return False


def product_sum(op: Op) -> tuple[Reduce, Expr | None, Binary] | None:
    """``(sum, epilogue, product)`` for an op (not a scatter) whose body is a ``ReduceAdd`` of a
    product under an optional epilogue (``split_epilogue``); None for any other op."""
    parts = split_epilogue(op.body, op) if op.scatter is None else None
    if parts is None:
        return None
    reduce, epilogue = parts
    product = reduce.body
    if reduce.kind != "ReduceAdd" or not isinstance(product, Binary) or product.op != "*":
        return None
    return reduce, epilogue, product


def sum_of_product(op: Op) -> tuple[Reduce, Expr | None, Read, Read] | None:
    """``(sum, epilogue, left, right)`` for a float32 op whose body is a ``product_sum`` of two
    reads ``left * right``; None for any other op."""
    parts = product_sum(op) if op.dtype == "float32" else None
    if parts is None:
        return None
    reduce, epilogue, product = parts
    if not (isinstance(product.a, Read) and isinstance(product.b, Read)):
        return None
    return reduce, epilogue, product.a, product.b


def with_reduce(epilogue: Expr | None, value: Expr) -> Expr:
    """The body ``split_epilogue`` came from, with ``value`` (a rewritten
    reduction, or a constant) in place of its reduction."""
    if epilogue is None:
        return value

    def put(node: Expr) -> Expr:
        return value if isinstance(node, Reduce) else map_children(node, put)

    return put(epilogue)


def _unit_variable(expr: sympy.Expr, modulus: int, candidates: list[str]) -> str | None:
    """The first of ``candidates`` that ``expr`` (affine) has with a coefficient coprime
    to ``modulus`` (each residue class of such a variable meets the lattice in one class)."""
    for name in candidates:
        coefficient = sympy.expand(expr).coeff(index.var(name))
        if coefficient.is_Integer and coefficient != 0 and math.gcd(int(coefficient), modulus) == 1:
            return name
    return None


def _and(parts: list[Expr]) -> Expr | None:
    result: Expr | None = None
    for part in parts:
        result = part if result is None else Binary("&&", result, part)
    return result


@dataclass
class _State:
    indices: list[str]
    extent: dict[str, int]
    strides: dict[str, int]
    base: int
    reduce: Reduce
    epilogue: Expr | None


@lru_cache(maxsize=1 << 16)
def _replaced(expr: sympy.Expr, variable: sympy.Symbol, value: sympy.Expr) -> sympy.Expr:
    """``expr`` with ``variable`` replaced by ``value``.  Cached across ops: the fusion planner splits
    every candidate kernel holding a strided op, whose inlined bodies repeat the same index
    expressions, and sympy's evaluation of each (floor, Mod) was most of a ShuffleNet's planning time;
    xreplace, as sympy's pattern-matching subs is not needed to replace a symbol."""
    return expr.xreplace({variable: value}) if variable in expr.free_symbols else expr


def _substitute(state: _State, name: str, modulus: int, residue: int, output: bool) -> _State | None:
    """``state`` with ``name = modulus * name' + residue``; None when ``name'`` has no values
    and ``name`` is an output variable (the piece has no points at all)."""
    taken = set(state.extent)
    new = index.fresh_name(f"{name}_", taken)
    count = -(-(state.extent[name] - residue) // modulus)
    if count <= 0 and output:
        return None
    variable, value = index.var(name), modulus * index.var(new) + residue

    def rewrite(node: Expr | None) -> Expr | None:
        return None if node is None else map_indices(node, lambda e: _replaced(e, variable, value))

    extent = {(new if v == name else v): e for v, e in state.extent.items()}
    extent[new] = max(count, 0)
    reduce = state.reduce
    axes = tuple(new if a == name else a for a in reduce.axes)
    extents = tuple(None if a == new else e for a, e in zip(axes, reduce.extents, strict=True))
    where = rewrite(reduce.where)
    reduce = Reduce(reduce.kind, axes, extents, rewrite(reduce.body), where)
    strides, base = dict(state.strides), state.base
    indices = state.indices
    if output:
        stride = strides.pop(name)
        strides[new] = stride * modulus
        base += stride * residue
        indices = [new if v == name else v for v in indices]
    return _State(indices, extent, strides, base, reduce, rewrite(state.epilogue) if output else state.epilogue)


def _simplify(state: _State) -> tuple[_State, bool]:
    """Drop conjuncts that became true; report whether one became false (empty reduction)."""
    reduce = state.reduce
    no_points = any(state.extent[a] == 0 for a in reduce.axes)
    if reduce.where is None:
        return state, no_points
    # a conjunct comparing two constants is decided (``condition_value`` over no variables)
    values = [(part, condition_value(part, {})) for part in conjuncts(reduce.where)]
    if any(value is False for _, value in values):
        return state, True
    where = _and([part for part, value in values if value is None])
    return replace(state, reduce=Reduce(reduce.kind, reduce.axes, reduce.extents, reduce.body, where)), no_points


def _without_unit_axes(reduce: Reduce, extent: dict[str, int]) -> Reduce:
    """``reduce`` with each axis of extent one replaced by 0 and dropped, as long as
    another axis remains: a sum over one point is its term.  An inlined producer
    can leave such an axis indexing only one operand (``x6[b, c, ..]`` with ``c``
    of extent one read as ``x[b, 0, ..]``), which no intrinsic axis could take."""
    unit = [a for a in reduce.axes if extent.get(a) == 1]
    if not unit or len(unit) == len(reduce.axes):
        return reduce
    zero = {index.var(a): 0 for a in unit}

    def rewrite(node: Expr | None) -> Expr | None:
        return None if node is None else map_indices(node, lambda e: e.subs(zero))

    kept = [(a, e) for a, e in zip(reduce.axes, reduce.extents, strict=True) if a not in unit]
    axes, extents = tuple(a for a, _ in kept), tuple(e for _, e in kept)
    return Reduce(reduce.kind, axes, extents, rewrite(reduce.body), rewrite(reduce.where))


@lru_cache(maxsize=1024)
def split_lattice(op: Op) -> tuple[Piece, ...] | None:
    """``op``'s domain as dense pieces (one piece, the op itself, when its reduction
    has no lattice condition; each piece's reduction without its axes of extent
    one, ``_without_unit_axes``); None when a lattice condition has no variable with
    a coefficient coprime to its modulus to split on, when too many pieces would
    result, or when a max or min has an epilogue where it is empty.
    Cached: the blocked kernel's planner, the lowering and the cost model all ask."""
    parts = split_epilogue(op.body, op)
    if parts is None:
        return None
    reduce, epilogue = parts
    strides = {v: math.prod(op.shape[d + 1 :]) for d, v in enumerate(op.indices)}
    pending = [_State(list(op.indices), op.extent, strides, 0, reduce, epilogue)]
    done: list[tuple[_State, bool]] = []
    while pending:
        state = pending.pop()
        where = state.reduce.where
        lattices = [] if where is None else [c for c in map(lattice_condition, conjuncts(where)) if c is not None]
        found = lattices[0] if lattices else None
        if found is None:
            done.append((state, False))
            continue
        expr, modulus = found
        name = _unit_variable(expr, modulus, state.indices)
        output = name is not None
        if name is None:
            name = _unit_variable(expr, modulus, list(state.reduce.axes))
        if name is None or modulus > (MAX_PIECES - len(done) - len(pending) if output else MAX_RESIDUES):
            return None  # too many pieces, or residues to try (a stride of 10007 took minutes to try)
        splits = []
        for residue in range(modulus):
            split = _substitute(state, name, modulus, residue, output)
            if split is not None:
                splits.append(_simplify(split))
        if output:
            # each residue class of an output variable is a piece of its own
            done += [item for item in splits if item[1]]
            pending += [s for s, empty in splits if not empty]
        else:
            # the residue classes of a reduction variable are summed: only one may remain
            alive = [s for s, empty in splits if not empty]
            if len(alive) > 1:
                return None
            if alive:
                pending.append(alive[0])
            else:
                done.append((splits[0][0], True))
        if len(done) + len(pending) > MAX_PIECES:
            return None
    pieces = []
    for state, empty in sorted(done, key=lambda item: item[0].base):
        shape = tuple(state.extent[v] for v in state.indices)
        if math.prod(shape) == 0:
            continue
        body = with_reduce(state.epilogue, _without_unit_axes(state.reduce, state.extent))
        if empty and state.epilogue is not None and not _zero(with_reduce(state.epilogue, Const(0.0))):
            if state.reduce.kind != "ReduceAdd":
                return None  # an empty max or min has no value for the epilogue to finish
            # the epilogue of an empty sum is not zero there: an element-wise piece computes it
            body, empty = with_reduce(state.epilogue, Const(0.0)), False
        axes = dict.fromkeys(a for r in reductions(body) for a in r.axes)  # nested reductions' too
        ranges = tuple((v, state.extent[v]) for v in (*state.indices, *axes))
        piece_op = Op(Tensor(op.name, shape, op.dtype), tuple(state.indices), body, op.inputs, ranges)
        pieces.append(Piece(piece_op, state.strides, state.base, empty))
    return tuple(pieces)
