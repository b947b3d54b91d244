"""A contraction as implicit matrix products: rows, columns, depth and batch from the intrinsic mapper.

An op ``Out[x] = epilogue(ReduceAdd({r | where}, A(x, r) * B(x, r)))`` is first
cut into the dense pieces of its domain (``lattice.split_lattice``: a strided
adjoint's parity classes); each piece is then a matrix product

    C[m, n] = Σ_k a[m, k] · b[k, n]      (per batch point)

whose row index ``m`` is the fused output variables that only ``A`` reads, the
column index ``n`` those only ``B`` reads, the depth ``k`` the reduction axes both
read, and the batch the output variables both read.  Which variables fuse onto
which axis is the AMOS mapper's answer for a matrix intrinsic (``mapping``); the
operands ``a`` and ``b`` stay expressions of the op (reads through its own index
maps, under its padding guards, with the piece's remaining domain condition on
the operand whose variables it uses), so a kernel gathers its operand tiles from
the tensors as they are — no ``im2col`` copy.  Output element ``(m, n)`` of a piece goes to flat offset
``out_offset`` of the whole output.  Target independent: the CUDA emitter, the
tensor-core model and (later) the NPU compiler all read a ``GemmView``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import sympy

from neoflow.codegen.hardware import Hardware
from neoflow.codegen.lattice import Piece, piece_target, product_sum, split_epilogue, split_lattice, with_reduce
from neoflow.codegen.mapping import Mapping, mappings
from neoflow.ir import index
from neoflow.ir.expr import Binary, Const, Expr, Index, Reduce, Select, conjuncts, index_variables, map_indices
from neoflow.ir.op import Op
from neoflow.ir.simplify import read_offset

Axis = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class GemmView:
    """One dense piece of a contraction as a matrix product: ``batch``, ``m``, ``n`` and
    ``k`` are the op variables (with extents) fused onto each axis, outermost first;
    ``a`` (of batch, m and k variables) and ``b`` (of batch, k and n variables) are the
    operand expressions (the piece's domain condition guards the one whose variables it uses);
    ``epilogue`` is the piece's body with ``reduce`` in it (None: the
    sum alone); ``out_offset`` the flat output offset of a point (in the op's variables)."""

    op: Op
    batch: Axis
    m: Axis
    n: Axis
    k: Axis
    a: Expr
    b: Expr
    reduce: Reduce
    epilogue: Expr | None
    out_offset: sympy.Expr

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(batch, M, N, K)``: the points of each axis."""
        return tuple(math.prod(e for _, e in axis) for axis in (self.batch, self.m, self.n, self.k))  # type: ignore[return-value]

    @property
    def macs(self) -> int:
        """Multiply-adds of the unpadded product."""
        return math.prod(self.sizes)


def _factors(product: Expr) -> tuple[Expr, Expr] | None:
    """The two factors of a product, ``Select(c, x * y, 0)`` read as ``Select(c, x, 0) * y``, and
    ``(x * y) * z`` as ``x * (y * z)`` where ``y`` and ``z`` read at the same variables and ``x``
    at others (so each factor is one operand)."""
    if isinstance(product, Binary) and product.op == "*":
        a, b = product.a, product.b
        if isinstance(a, Binary) and a.op == "*" and not _same_point(a) and _same_point(Binary("*", a.b, b)):
            return a.a, Binary("*", a.b, b)
        if isinstance(a, Binary) and a.op == "*" and not _same_point(a) and _same_point(Binary("*", a.a, b)):
            return a.b, Binary("*", a.a, b)
        return a, b
    if isinstance(product, Select) and isinstance(product.b, Const) and product.b.value == 0:
        inner = _factors(product.a)
        if inner is not None:
            return Select(product.cond, inner[0], Const(0.0)), inner[1]
    return None


def pin_axes(reduce: Reduce, extent: dict[str, int]) -> Reduce:
    """``reduce`` without the axes its domain condition fixes to a constant (``e_mod2 == 0``,
    left by a strided adjoint): each replaced by its value, its conjunct dropped."""
    if reduce.where is None:
        return reduce
    fixed: dict[str, int] = {}
    kept = []
    for part in conjuncts(reduce.where):
        if (
            isinstance(part, Binary)
            and part.op == "=="
            and isinstance(part.a, Index)
            and part.a.expr.is_Symbol
            and part.a.expr.name in reduce.axes
            and isinstance(part.b, Const)
            and 0 <= int(part.b.value) < extent[part.a.expr.name]
        ):
            fixed[part.a.expr.name] = int(part.b.value)
        else:
            kept.append(part)
    if not fixed:
        return reduce
    values = {index.var(name): value for name, value in fixed.items()}

    def substitute(node: Expr) -> Expr:
        return map_indices(node, lambda e: e.subs(values))

    where = None
    for part in kept:
        where = substitute(part) if where is None else Binary("&&", where, substitute(part))
    axes = [(a, e) for a, e in zip(reduce.axes, reduce.extents, strict=True) if a not in fixed]
    return Reduce(reduce.kind, tuple(a for a, _ in axes), tuple(e for _, e in axes), substitute(reduce.body), where)


def _same_point(node: Expr) -> bool:
    """Whether every read of ``node`` uses the same index variables."""
    return len({frozenset(index_variables(r)) for r in node.reads()}) <= 1


def _ordered(variables: tuple[str, ...], order: tuple[str, ...], extent: dict[str, int]) -> Axis:
    return tuple((v, extent[v]) for v in order if v in variables)


def _memory_order(variables: tuple[str, ...], operands: tuple[Expr, ...], op: Op) -> tuple[str, ...]:
    """``variables`` (the depth's) from the largest stride to the smallest in the first operand that
    reads them affinely (ties by the next): a depth tile then runs along memory where it can, so its
    loads coalesce and the kernel can move runs of it as vectors."""
    shapes = {t.name: t.shape for t in op.inputs}
    keys: dict[str, list[int]] = {v: [] for v in variables}
    for operand in operands:
        reads = operand.reads()
        if len(reads) != 1:
            continue
        offset = sympy.expand(read_offset(reads[0].indices, shapes[reads[0].tensor], op.extent))
        symbols = [index.var(v) for v in variables]
        if not offset.is_polynomial(*symbols) or any(sympy.degree(offset, s) > 1 for s in symbols):
            continue
        for v, symbol in zip(variables, symbols, strict=True):
            coefficient = offset.coeff(symbol)
            keys[v].append(-abs(int(coefficient)) if coefficient.is_Integer else 0)
    position = {v: k for k, v in enumerate(variables)}
    return tuple(sorted(variables, key=lambda v: (*keys[v], position[v])))


def _representative(factor: Expr) -> Expr:
    """What the mapper sees of an operand: the factor itself, or, where it reads several tensors
    at the same variables (a gradient masked by its ReLU's output), its first read alone (the
    access pattern is the same; the kernel still evaluates the whole factor)."""
    reads = factor.reads()
    if len(reads) > 1 and _same_point(factor) and not any(isinstance(n, Reduce) for n in factor.walk()):
        return reads[0]
    return factor


def _best(found: list[Mapping], batch_ok: set[str]) -> Mapping | None:
    """The mapping that leaves only batch variables outside the intrinsic, fusing the most."""
    usable = [m for m in found if set(m.outer) <= batch_ok]
    if not usable:
        return None
    return min(usable, key=lambda m: (len(m.outer), m.cycles))


def piece_view(piece: Piece, whole: Op, target: Hardware) -> GemmView | None:
    """``piece`` of ``whole`` as a ``GemmView`` on ``target``'s matrix intrinsic, or None
    when it is no sum of a product of two operands the intrinsic can take."""
    op = piece.op
    parts = split_epilogue(op.body, op)
    if parts is None:
        return None
    reduce, epilogue = parts
    if reduce.kind != "ReduceAdd" or any(isinstance(n, Reduce) for n in reduce.body.walk()):
        return None
    pinned = pin_axes(reduce, op.extent)
    if pinned is not reduce:  # the op without the pinned axes
        epilogue = with_reduce(epilogue, pinned) if epilogue is not None else None
        ranges = tuple((v, e) for v, e in op.ranges if v in op.indices or v in pinned.axes or v not in reduce.axes)
        op = Op(op.output, op.indices, epilogue if epilogue is not None else pinned, op.inputs, ranges)
        reduce = pinned
    factors = _factors(reduce.body)
    if factors is None or not op.dtype.startswith("float"):
        return None
    left, right = factors
    bare = Reduce("ReduceAdd", reduce.axes, reduce.extents, Binary("*", _representative(left), _representative(right)))
    probe = Op(op.output, op.indices, bare, op.inputs, op.ranges)
    extent = op.extent
    used_left, used_right = index_variables(left), index_variables(right)
    batch_ok = {v for v in op.indices if (v in used_left) == (v in used_right)}
    if reduce.where is not None and not index_variables(reduce.where) <= used_left | used_right | set(op.indices):
        return None
    mapping = _best(mappings(probe, target), batch_ok)
    if mapping is None:
        return None
    axes = dict(mapping.axes)
    operands = dict(mapping.operands)
    a_expr, b_expr = (left, right) if operands["a"] == _first_tensor(left) else (right, left)
    if reduce.where is not None:
        # the domain condition guards the operand whose rows, with the depth and batch, it uses
        shared = set(axes["k"]) | set(mapping.outer)
        used = index_variables(reduce.where)
        if used <= set(axes["i"]) | shared:
            a_expr = Select(reduce.where, a_expr, Const(0.0))
        elif used <= set(axes["j"]) | shared:
            b_expr = Select(reduce.where, b_expr, Const(0.0))
        else:
            return None  # a condition tying rows to columns: no matrix product
    target_index = piece_target(piece, whole.shape)
    if target_index is None:
        return None
    offset = sympy.expand(index.flat_offset(target_index, whole.shape))
    return GemmView(
        op,
        _ordered(mapping.outer, op.indices, extent),
        _ordered(axes["i"], op.indices, extent),
        _ordered(axes["j"], op.indices, extent),
        _ordered(axes["k"], _memory_order(tuple(reduce.axes), (a_expr, b_expr), op), extent),
        a_expr,
        b_expr,
        Reduce("ReduceAdd", reduce.axes, reduce.extents, Binary("*", a_expr, b_expr)),
        epilogue,
        offset,
    )


def _first_tensor(node: Expr) -> str | None:
    reads = node.reads()
    return reads[0].tensor if reads else None


def _lattice_guarded(node: Expr) -> bool:
    """Whether ``node`` holds a divisibility (``x % 2 == 0``) or a division in an index."""
    return any(isinstance(n, Index) and n.expr.has(sympy.Mod, sympy.floor) for n in node.walk())


def guards_to_domain(op: Op, lattice_only: bool = True) -> Op:
    """``op`` with a factor ``Select(cond, x, 0)`` of its sum, whose condition is a lattice
    (a transposed convolution's ``(h - r) % 2 == 0`` and bounds), moved into the sum's domain
    condition: the same sum (the terms it skips are zeros), and ``split_lattice`` then cuts the
    domain into dense pieces whose reads are affine.  Not ``lattice_only``: any such condition on
    the sum's axes (a padded convolution's bounds), which a loop nest then meets in its loops'
    bounds instead of testing at every point — a branch in the innermost loop kept a depthwise
    convolution from vectorising."""
    parts = product_sum(op)
    if parts is None:
        return op
    reduce, epilogue, product = parts
    factors = [product.a, product.b]
    for k, factor in enumerate(factors):
        if (
            isinstance(factor, Select)
            and isinstance(factor.b, Const)
            and factor.b.value == 0
            and (_lattice_guarded(factor.cond) or not lattice_only)
            and index_variables(factor.cond) & set(reduce.axes)
        ):
            factors[k] = factor.a
            where = factor.cond if reduce.where is None else Binary("&&", reduce.where, factor.cond)
            moved = Reduce(reduce.kind, reduce.axes, reduce.extents, Binary("*", *factors), where)
            return Op(op.output, op.indices, with_reduce(epilogue, moved), op.inputs, op.ranges)
    return op


@lru_cache(maxsize=1024)
def gemm_views(op: Op, target: Hardware) -> tuple[GemmView, ...] | None:
    """Every non-empty piece of ``op`` as a ``GemmView`` (its empty pieces, whose output is
    zero, are left out: a kernel zeroes them), or None when ``op`` is not a contraction the
    intrinsic of ``target`` can run whole."""
    if op.scatter is not None:
        return None
    pieces = split_lattice(guards_to_domain(op))
    if not pieces:
        return None
    views = []
    for piece in pieces:
        if piece.empty:
            continue
        view = piece_view(piece, op, target)
        if view is None:
            return None
        views.append(view)
    return tuple(views) if views else None


def covers_output(op: Op, views: tuple[GemmView, ...]) -> bool:
    """Whether the pieces of ``views`` write every element of ``op``'s output (else the
    rest, the empty pieces', must be zeroed first)."""
    return sum(math.prod(v.op.shape) for v in views) == op.output.size
