"""Depthwise convolutions and their adjoints: each plane padded once, rows summed in vectors.

A depthwise convolution (MobileNetV2's, ShuffleNetV2's)

    Y[n, c, h, w] = ReduceAdd({r, s | 0 <= h + r - 1 < H && 0 <= w + s - 1 < W},
                              X[n, c, h + r - 1, w + s - 1] * K[c, r, s]) + B[c]

sums nine terms a point, and as a loop nest each output row takes nine short passes whose
bounds the padding cuts (30-32 iterations): the compiler's vectorised loop pays its peeling
and remainder on every pass, and the row is read and written through memory each time
(6.2 ms for a 32 x 144 x 32 x 32 one on this 2-core machine, 9 GB/s). Here each input plane
is copied once into a zero-bordered buffer (stride-2 columns split into their two phases,
so that every tap reads consecutive elements), and each output row is summed in vector
registers — a block of up to four 8-float vectors, every tap one load and one FMA each —
then finished by the epilogue and stored once: 1.1 ms for that one.

Two forms read such a *plane* operand (a tensor, or point-wise prologues of reads at the same
indices, applied once per copied element) whose last two indices are
``stride * h + a * r + c`` and ``stride * w + b * s + d`` (strides 1 or 2, ``r``, ``s`` the
taps), under a sum whose domain condition (or the padding guard ``guards_to_domain`` moves
there) is exactly the plane read's bounds:

* ``window_plan``: the convolution — ``h``, ``w`` the output's last two indices, the taps
  reduction axes (any other of extent one), times a *weight* that does not read ``h`` or ``w``.
  The autodiff's input adjoint of a stride-1 depthwise convolution (``G[n, c, z - r + 1, ...]``)
  has this form too.
* ``window_gradient_plan``: its weight gradient,
  ``dK[c, r, s] = ReduceAdd({n, h, w | ...}, G[n, c, h, w] * X[n, c, h + r - 1, w + s - 1])`` —
  the taps output indices, ``h``, ``w`` reduction axes that a *gradient* operand reads as its
  last two indices; every tap's sum is kept in a vector register over the whole plane (a load
  of the gradient's row and one FMA a tap), then summed across its lanes.

``windowed`` finds either, ``window_function`` emits it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import sympy

from neoflow.codegen.c_expr import IndexPrinter, ValuePrinter, linear_index
from neoflow.codegen.implicit_gemm import guards_to_domain
from neoflow.codegen.lattice import product_sum
from neoflow.ir import index
from neoflow.ir.expr import Binary, Cast, Const, Expr, Index, Read, Unary, index_variables, map_children, map_indices
from neoflow.ir.op import Op
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS

#: floats in one vector of the row sums (AVX2; AVX-512 hardware runs two a register pair)
LANES = 8
#: vectors of one output row summed at once (their accumulators stay in registers)
BLOCK_VECTORS = 4
#: strides the plane's rows and columns may take
STRIDES = (1, 2)
#: the plane buffer (all column phases) stays within this many floats (a core's L2)
MAX_PLANE_FLOATS = 64 * 1024
#: the largest window (taps) taken: beyond it a sum per point is long enough for the loop nest,
#: and a weight gradient's accumulators no longer fit the vector registers
MAX_TAPS = 25
#: the variable names of a copied element's row and column in the plane's tensor
ROW, COL = "nf_iy", "nf_ix"


@dataclass(frozen=True)
class Axis:
    """One of the plane's two dimensions: ``position`` (``extent`` values: an output index of a
    convolution, a reduction axis of a weight gradient) read at ``stride * position +
    coefficient * tap + offset`` of a dimension of ``size`` elements; ``tap`` is the tap variable
    (``taps`` values) or None where the dimension takes none."""

    position: str
    extent: int
    stride: int
    tap: str | None
    taps: int
    coefficient: int
    offset: int
    size: int

    @property
    def lowest(self) -> int:
        """The lowest element any point and tap reads (below zero: padding)."""
        return self.offset + min(0, self.coefficient * (self.taps - 1))

    @property
    def highest(self) -> int:
        """The highest element any point and tap reads (at ``size`` or beyond: padding)."""
        return self.stride * (self.extent - 1) + self.offset + max(0, self.coefficient * (self.taps - 1))

    def shift(self, tap: int) -> int:
        """Where tap ``tap`` reads for position 0, counted from ``lowest``."""
        return self.coefficient * tap + self.offset - self.lowest


@dataclass(frozen=True)
class Plane:
    """The plane operand ``value`` (its reads' last two indices ``ROW`` and ``COL``: the copied
    element's) over ``rows`` and ``cols``, copied into a buffer of ``cols.stride`` column phases."""

    value: Expr
    rows: Axis
    cols: Axis

    @property
    def vectors(self) -> int:
        """Vectors a row of positions is summed in."""
        return -(-self.cols.extent // LANES)

    @property
    def taps(self) -> int:
        return self.rows.taps * self.cols.taps

    @property
    def pitch(self) -> int:
        """Floats a row of one column phase of the buffer holds: every vector every tap reads."""
        widest = max(self.cols.shift(t) for t in range(self.cols.taps)) // self.cols.stride
        return self.vectors * LANES + widest

    @property
    def buffer_rows(self) -> int:
        """Rows of the buffer: every row a position and tap reads."""
        rows = self.rows
        return rows.stride * (rows.extent - 1) + max(rows.shift(t) for t in range(rows.taps)) + 1

    @property
    def floats(self) -> int:
        return self.cols.stride * self.buffer_rows * self.pitch

    def tap_offset(self, tap: int) -> int:
        """Where tap ``tap`` (row-major over the row and column taps) reads in the buffer for position
        (0, 0): its column phase, row and column."""
        x, y = self.cols.shift(tap % self.cols.taps), self.rows.shift(tap // self.cols.taps)
        return ((x % self.cols.stride) * self.buffer_rows + y) * self.pitch + x // self.cols.stride


@dataclass(frozen=True)
class WindowPlan:
    """A convolution as ``epilogue(sum over the taps of plane * weight)`` (``weight``: the tap's
    factor); ``outer`` the output's indices but the plane's positions."""

    op: Op
    plane: Plane
    weight: Expr
    outer: tuple[tuple[str, int], ...]
    epilogue: Expr | None


@dataclass(frozen=True)
class WindowGradientPlan:
    """A weight gradient as ``epilogue(sum over batch and positions of gradient * plane)``: ``gradient``
    reads the positions as its last two indices; ``outer`` the output's indices but the taps (in
    output order), ``batch`` the sum's axes but the positions."""

    op: Op
    plane: Plane
    gradient: Expr
    outer: tuple[tuple[str, int], ...]
    batch: tuple[tuple[str, int], ...]
    epilogue: Expr | None


def _affine_parts(
    expr: sympy.Expr, positions: set[str], taps: set[str]
) -> tuple[str, int, str | None, int, int] | None:
    """``(position, stride, tap, coefficient, offset)`` of ``expr = stride * position + coefficient *
    tap + offset`` with integers, one of ``positions`` and at most one of ``taps``; else None."""
    symbols = index.variables(expr)
    used, placed = symbols & taps, symbols & positions
    if symbols - taps - positions or len(used) > 1 or len(placed) != 1:
        return None
    if not expr.is_polynomial(*expr.free_symbols):
        return None  # a division or modulo (a strided adjoint's parity)
    poly = sympy.Poly(expr, *[index.var(v) for v in sorted(symbols)])
    if poly.total_degree() > 1 or not all(c.is_Integer for c in poly.coeffs()):
        return None
    position = next(iter(placed))
    stride = int(expr.coeff(index.var(position)))
    tap = next(iter(used), None)
    coefficient = int(expr.coeff(index.var(tap))) if tap else 0
    if stride not in STRIDES or (tap is not None and coefficient == 0):
        return None
    return position, stride, tap, coefficient, _constant(expr)


def _constant(expr: sympy.Expr) -> int:
    return int(expr.subs({s: 0 for s in expr.free_symbols}))


def _bounds(cond: Expr | None) -> dict[sympy.Expr, list[int]] | None:
    """Each index expression's ``[low, high]`` bounds (the expression less its constant) that a
    conjunction of comparisons with constants sets (``{}`` for no condition); None for any other."""
    found: dict[sympy.Expr, list[int]] = {}
    stack = [] if cond is None else [cond]
    while stack:
        node = stack.pop()
        if isinstance(node, Binary) and node.op == "&&":
            stack += [node.a, node.b]
            continue
        if not (isinstance(node, Binary) and node.op in ("<", "<=", ">", ">=")):
            return None
        if not (isinstance(node.a, Index) and isinstance(node.b, Const) and isinstance(node.b.value, int)):
            return None
        constant = _constant(node.a.expr)
        expr, value = node.a.expr - constant, node.b.value - constant
        low, high = found.setdefault(expr, [-math.inf, math.inf])
        if node.op in (">", ">="):
            found[expr][0] = max(low, value + (node.op == ">"))
        else:
            found[expr][1] = min(high, value - (node.op == "<"))
    return found


def _exactly_in_bounds(cond: Expr | None, indices: list[sympy.Expr], axes: list[Axis]) -> bool:
    """Whether the sum's domain condition keeps exactly the terms whose plane read lies in the
    tensor: over the values each index takes, its bounds cut where the tensor ends (a bound that
    cuts nothing may be there or not: a lattice piece's), and nothing else is bounded."""
    bounds = _bounds(cond)
    if bounds is None:
        return False
    keys = []
    for expr, axis in zip(indices, axes, strict=True):
        constant = _constant(expr)
        key = expr - constant
        low, high = bounds.get(key, [-math.inf, math.inf])
        first, last = axis.lowest - constant, axis.highest - constant  # the values the key takes
        if (max(low, first), min(high, last)) != (max(-constant, first), min(axis.size - 1 - constant, last)):
            return False
        keys.append(key)
    return set(bounds) <= set(keys)


def _same_index_reads(expr: Expr) -> list[Read] | None:
    """The reads of a point-wise ``expr`` (no reduction, no selection) where all read tensors of one
    shape's rank at the same indices, else None."""
    reads = [n for n in expr.walk() if isinstance(n, Read)]
    if not reads or any(r.indices != reads[0].indices for r in reads):
        return None
    if not all(isinstance(n, (Read, Binary, Unary, Cast, Const)) for n in expr.walk()):
        return None
    return reads


def _plane(op: Op, factor: Expr, positions: set[str], taps: set[str], others: set[str], where: Expr | None):
    """``factor`` as a ``Plane`` read at ``positions`` and ``taps`` in its last two indices and at
    ``others`` in the rest, the sum's domain condition ``where`` exactly its bounds; else None."""
    reads = _same_index_reads(factor)
    if reads is None:
        return None
    shapes = {t.name: t.shape for t in op.inputs}
    indices = list(reads[0].indices)
    if len(indices) < 2 or len({shapes[r.tensor] for r in reads}) > 1:
        return None
    axes = []
    for k in (-2, -1):
        found = _affine_parts(indices[k], positions, taps)
        if found is None:
            return None
        position, stride, tap, coefficient, offset = found
        taps_of = op.extent[tap] if tap else 1
        axes.append(
            Axis(position, op.extent[position], stride, tap, taps_of, coefficient, offset, shapes[reads[0].tensor][k])
        )
    rows, cols = axes
    if rows.position == cols.position or (rows.tap == cols.tap and rows.tap is not None):
        return None
    if {a.tap for a in axes} - {None} != taps or any(index.variables(i) - others for i in indices[:-2]):
        return None
    if not _exactly_in_bounds(where, indices[-2:], axes):
        return None

    def at_element(node: Expr) -> Expr:
        if isinstance(node, Read):
            return Read(node.tensor, (*node.indices[:-2], index.var(ROW), index.var(COL)), node.tensor_dtype)
        return map_children(node, at_element)

    plane = Plane(at_element(factor), rows, cols)
    return plane if plane.floats <= MAX_PLANE_FLOATS and plane.taps <= MAX_TAPS else None


def _sum_parts(op: Op):
    """``(reduce, epilogue, factors)`` of a float32 op whose body is a sum of a product (a padding guard
    moved into its domain; reduction axes of extent one set to zero), else None."""
    if op.scatter is not None or op.dtype != "float32" or any(t.dtype != "float32" for t in op.inputs):
        return None
    parts = product_sum(guards_to_domain(op, lattice_only=False))
    if parts is None:
        return None
    reduce, epilogue, product = parts
    unit = {index.var(a): 0 for a in reduce.axes if op.extent[a] == 1}
    factors = tuple(map_indices(f, lambda e: e.subs(unit)) for f in (product.a, product.b))
    where = None if reduce.where is None else map_indices(reduce.where, lambda e: e.subs(unit))
    return reduce, where, epilogue, factors


@lru_cache(maxsize=1024)
def window_plan(op: Op) -> WindowPlan | None:
    """The ``WindowPlan`` of a convolution-form ``op``, else None (module docstring).  Cached: the
    lowering and the fusion cost model both ask."""
    parts = _sum_parts(op) if len(op.indices) >= 2 else None
    if parts is None:
        return None
    reduce, where, epilogue, factors = parts
    taps = {a for a in reduce.axes if op.extent[a] > 1}
    h, w = op.indices[-2:]
    planar = [k for k, f in enumerate(factors) if {h, w} & index_variables(f)]
    if len(planar) != 1:
        return None
    weight = factors[1 - planar[0]]
    outer = tuple((v, op.extent[v]) for v in op.indices[:-2])
    plane = _plane(op, factors[planar[0]], {h, w}, taps, {v for v, _ in outer}, where)
    if plane is None or (plane.rows.position, plane.cols.position) != (h, w):
        return None
    return WindowPlan(op, plane, weight, outer, epilogue)


@lru_cache(maxsize=1024)
def window_gradient_plan(op: Op) -> WindowGradientPlan | None:
    """The ``WindowGradientPlan`` of a weight-gradient-form ``op``, else None (module docstring)."""
    parts = _sum_parts(op)
    if parts is None:
        return None
    reduce, where, epilogue, factors = parts
    axes = {a for a in reduce.axes if op.extent[a] > 1}
    for k, gradient in enumerate(factors):
        reads = _same_index_reads(gradient)
        if reads is None or len(reads[0].indices) < 2:
            continue
        h, w = (str(i) for i in reads[0].indices[-2:])
        if not {h, w} <= axes or h == w:
            continue
        planes = _same_index_reads(factors[1 - k])
        if planes is None or len(planes[0].indices) < 2:
            continue
        last = set().union(*(index.variables(i) for i in planes[0].indices[-2:]))
        taps = {v for v in op.indices if op.extent[v] > 1 and v in last}
        outer = tuple((v, op.extent[v]) for v in op.indices if v not in taps)
        batch = tuple((a, op.extent[a]) for a in reduce.axes if a not in (h, w) and op.extent[a] > 1)
        others = {v for v, _ in outer} | {a for a, _ in batch}
        if any(index.variables(i) - others for i in reads[0].indices[:-2]):
            continue
        # depthwise: each plane and each gradient row belongs to one output point (a full convolution's
        # weight gradient would copy a plane once per output channel: the blocked kernel's work)
        spread = {v for v, e in outer if e > 1}
        if any(not spread <= set().union(*map(index.variables, r.indices[:-2])) for r in (reads[0], planes[0])):
            continue
        plane = _plane(op, factors[1 - k], {h, w}, taps, others, where)
        if plane is None or (plane.rows.position, plane.cols.position) != (h, w) or not taps:
            continue
        return WindowGradientPlan(op, plane, gradient, outer, batch, epilogue)
    return None


def windowed(op: Op) -> WindowPlan | WindowGradientPlan | None:
    """``op``'s convolution form, else its weight-gradient form, else None."""
    return window_plan(op) or window_gradient_plan(op)


class _Printer:
    """C for one window kernel's values: ``v_<variable>`` index variables, ``acc_`` the sum."""

    def __init__(self, op: Op, plane: Plane) -> None:
        tensors = {t.name: t for t in op.inputs}
        names = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
        extents = dict(op.extent) | {ROW: plane.rows.size, COL: plane.cols.size}
        self.index = IndexPrinter(lambda v: f"v_{v}", lambda t, idx: self.values.read(t, idx))
        self.values = ValuePrinter(tensors, names, self.index, lambda node: "acc_", extents, in_lanes=True)

    def __call__(self, expr: Expr | None) -> str:
        return "acc_" if expr is None else self.values(expr, "float32")


def _decode(variables: tuple[tuple[str, int], ...], flat: str) -> str:
    """C declaring ``v_<variable>`` for each of ``variables`` (row-major) from the flat index ``flat``."""
    lines, rest = [], flat
    for v, e in reversed(variables):
        lines.append(f"const int64_t v_{v} = {rest} % {e};")
        rest = f"({rest} / {e})"
    return " ".join(lines)


def _fill(plane: Plane, value: str) -> str:
    """C copying the plane (``value``: the element at ``v_<ROW>``, ``v_<COL>``) into ``plane_``, zeros
    outside the tensor, each column phase's columns together (through ``line_`` where there are two)."""
    rows, cols, pitch, phases = plane.rows, plane.cols, plane.pitch, plane.cols.stride
    deinterleave = ""
    if phases > 1:  # column phase q_ holds columns q_, q_ + phases, ...: each tap then reads consecutive elements
        deinterleave = f"""for (int64_t q_ = 0; q_ < {phases}; ++q_)
                for (int64_t x_ = 0; x_ < {pitch}; ++x_)
                    plane_[(q_ * {plane.buffer_rows} + y_) * {pitch} + x_] = line_[x_ * {phases} + q_];"""
    target = f"plane_ + y_ * {pitch}" if phases == 1 else "line_"
    # the columns inside the tensor, [first, end) of the line, copied without a test per element (a
    # test there kept the copy out of vector lanes, and with a clamp inlined into it the compiler
    # vectorised it badly: MobileNetV2's stride-2 depthwise convolutions took 2-3x their estimate)
    width = phases * pitch
    first = min(width, max(0, -cols.lowest))
    end = max(first, min(width, cols.size - cols.lowest))
    return f"""for (int64_t y_ = 0; y_ < {plane.buffer_rows}; ++y_) {{
            const int64_t v_{ROW} = y_ + {rows.lowest};
            float *to_ = {target};
            if (v_{ROW} >= 0 && v_{ROW} < {rows.size}) {{
                for (int64_t x_ = 0; x_ < {first}; ++x_) to_[x_] = 0.0f;
                for (int64_t x_ = {first}; x_ < {end}; ++x_) {{
                    const int64_t v_{COL} = x_ + {cols.lowest};
                    to_[x_] = {value};
                }}
                for (int64_t x_ = {end}; x_ < {width}; ++x_) to_[x_] = 0.0f;
            }} else
                for (int64_t x_ = 0; x_ < {width}; ++x_) to_[x_] = 0.0f;
            {deinterleave}
        }}"""


def _taps(op: Op, plane: Plane) -> tuple[str, str]:
    """C loops over the plane's tap variables, and the flat tap index (row-major) in them."""
    rows, cols = plane.rows, plane.cols
    loops = " ".join(f"for (int64_t v_{t} = 0; v_{t} < {op.extent[t]}; ++v_{t})" for t in (rows.tap, cols.tap) if t)
    flat = " + ".join([f"v_{rows.tap} * {cols.taps}" if rows.tap else "0", f"v_{cols.tap}" if cols.tap else "0"])
    return loops, flat


def _per_outer_point(outer: tuple[tuple[str, int], ...], plane: Plane, parallel: bool, row: str) -> str:
    """C opening the loop over the outer points (in parallel where ``parallel``): their variables, the
    plane buffer and ``row`` (a row of positions' floats, aligned) beside the copy's line buffer."""
    pragma = "#pragma omp parallel for" if parallel else ""
    return f"""{pragma}
    for (int64_t p_ = 0; p_ < {math.prod(e for _, e in outer)}; ++p_) {{
        {_decode(outer, "p_")}
        {_buffers(plane, row)}"""


def _buffers(plane: Plane, row: str) -> str:
    """C declaring the plane buffer, ``row`` (a row of positions' floats, aligned) and the copy's line buffer."""
    return f"""NF_SCRATCH(float, plane_, {plane.floats});
        float {row}[{plane.vectors * LANES}] __attribute__((aligned(32))), line_[{plane.cols.stride * plane.pitch}];"""


def _header(op: Op, name: str) -> str:
    inputs = "".join(f", const float *restrict in{k}" for k in range(len(op.inputs)))
    vector = f"typedef float nf_wv __attribute__((vector_size({LANES * 4}), aligned(4)));"
    return f"{vector}\nvoid {name}(float *restrict out{inputs})"


def _placed(op: Op, placement: tuple[int, dict[str, int]] | None) -> str:
    """C of where point ``v_<index>...`` of ``op`` goes in ``out``: ``placement`` ``(base, strides)``
    (a lattice piece's slice of the whole output), else row-major."""
    if placement is None:
        return linear_index([f"v_{v}" for v in op.indices], op.shape)
    base, strides = placement
    return " + ".join([str(base), *(f"v_{v} * {strides[v]}" for v in op.indices)])


def window_function(
    op: Op, plan: WindowPlan | WindowGradientPlan, name: str, placement: tuple[int, dict[str, int]] | None = None
) -> str:
    """The C function ``name`` computing ``op`` by ``plan`` (a convolution's or a weight gradient's),
    each point stored where ``placement`` (``(base, strides)``, a lattice piece's) puts it, else
    row-major."""
    if isinstance(plan, WindowGradientPlan):
        return _gradient_function(op, plan, name, placement)
    return window_pieces_function(op, [(plan, placement)], name)


def window_pieces_function(
    op: Op, pieces: Sequence[tuple[WindowPlan, tuple[int, dict[str, int]] | None]], name: str
) -> str:
    """The C function ``name`` computing ``op`` by convolution plans over the same outer points (the
    lattice pieces of a strided depthwise convolution's input adjoint, each ``(plan, placement)``):
    one loop over the outer points, each point's planes computed by every piece in turn.  Piece by
    piece, each pass over the output stored every other element of every plane and read the
    epilogue's tensors (a ReLU6's mask) the same way, four times over memory: a MobileNetV2 block's
    adjoint took 4.9 ms against its estimate's 1.25."""
    outer = pieces[0][0].outer
    assert all(plan.outer == outer for plan, _ in pieces), "pieces of one loop share their outer points"
    points = sum(math.prod(e for _, e in outer) * plan.plane.rows.extent * plan.plane.cols.extent for plan, _ in pieces)
    pragma = "#pragma omp parallel for" if points >= PARALLEL_MIN_POINTS else ""
    bodies = "\n        ".join(_conv_point(plan, placement) for plan, placement in pieces)
    return f"""{_header(op, name)} {{
    {pragma}
    for (int64_t p_ = 0; p_ < {math.prod(e for _, e in outer)}; ++p_) {{
        {_decode(outer, "p_")}
        {bodies}
    }}
}}
"""


def _conv_point(plan: WindowPlan, placement: tuple[int, dict[str, int]] | None) -> str:
    """C (a block of its own) computing ``plan.op``'s points of one outer point (``v_<outer>`` set):
    the plane copied, the taps' weights, each row of positions summed in vectors, the epilogue
    applied in vector lanes, the row stored where ``placement`` puts it."""
    op, plane = plan.op, plan.plane
    printer = _Printer(op, plane)
    rows, cols = plane.rows, plane.cols
    tap_loops, tap = _taps(op, plane)
    blocks = []
    for first in range(0, plane.vectors, BLOCK_VECTORS):
        count = min(BLOCK_VECTORS, plane.vectors - first)
        sums = []
        for t in range(plane.taps):
            loads = (
                f"a{j} += k_[{t}] * *(const nf_wv *)(src_ + {plane.tap_offset(t) + (first + j) * LANES});"
                for j in range(count)
            )
            sums.append(" ".join(loads))
        stores = " ".join(f"*(nf_wv *)(row_ + {(first + j) * LANES}) = a{j};" for j in range(count))
        zeros = ", ".join(f"a{j} = {{0}}" for j in range(count))
        newline = "\n                "
        blocks.append(f"""{{
                nf_wv {zeros};
                {newline.join(sums)}
                {stores}
            }}""")
    return f"""{{
        {_buffers(plane, "row_")}
        {_fill(plane, printer(plane.value))}
        float k_[{plane.taps}];
        {tap_loops} k_[{tap}] = {printer(plan.weight)};
        for (int64_t v_{rows.position} = 0; v_{rows.position} < {rows.extent}; ++v_{rows.position}) {{
            const float *src_ = plane_ + v_{rows.position} * {rows.stride * plane.pitch};
            {"".join(blocks)}
            /* the epilogue in vector lanes (its selections without branches), then the row stored */
            #pragma omp simd
            for (int64_t v_{cols.position} = 0; v_{cols.position} < {cols.extent}; ++v_{cols.position}) {{
                const float acc_ = row_[v_{cols.position}];
                row_[v_{cols.position}] = (float)({printer(plan.epilogue)});
            }}
            for (int64_t v_{cols.position} = 0; v_{cols.position} < {cols.extent}; ++v_{cols.position})
                out[{_placed(op, placement)}] = row_[v_{cols.position}];
        }}
        }}"""


def _gradient_function(
    op: Op, plan: WindowGradientPlan, name: str, placement: tuple[int, dict[str, int]] | None
) -> str:
    """A weight gradient: per outer point (in parallel), per batch point the plane copied, then per
    row of positions the gradient's row (zeros past its end) times each tap's shifted plane row into
    the tap's vector accumulator; the lanes summed, the epilogue applied at each tap."""
    plane, printer = plan.plane, _Printer(op, plan.plane)
    rows, cols = plane.rows, plane.cols
    outer_points, batch_points = math.prod(e for _, e in plan.outer), math.prod(e for _, e in plan.batch)
    accumulate = []
    for t in range(plane.taps):
        accumulate.append(f"a{t} += g_ * *(const nf_wv *)(src_ + {plane.tap_offset(t)});")
    lanes = " + ".join(f"a_[{lane}]" for lane in range(LANES))
    sums = " ".join(f"{{ const nf_wv a_ = a{t}; sums_[{t}] = {lanes}; }}" for t in range(plane.taps))
    tap_loops, tap = _taps(op, plane)
    target = _placed(op, placement)
    parallel = outer_points * batch_points * rows.extent * cols.extent >= PARALLEL_MIN_POINTS
    newline = "\n                    "
    return f"""{_header(op, name)} {{
    {_per_outer_point(plan.outer, plane, parallel, "gradient_")}
        for (int64_t x_ = 0; x_ < {plane.vectors * LANES}; ++x_) gradient_[x_] = 0.0f;
        nf_wv {", ".join(f"a{t} = {{0}}" for t in range(plane.taps))};
        for (int64_t b_ = 0; b_ < {batch_points}; ++b_) {{
            {_decode(plan.batch, "b_")}
            {_fill(plane, printer(plane.value))}
            for (int64_t v_{rows.position} = 0; v_{rows.position} < {rows.extent}; ++v_{rows.position}) {{
                for (int64_t v_{cols.position} = 0; v_{cols.position} < {cols.extent}; ++v_{cols.position})
                    gradient_[v_{cols.position}] = {printer(plan.gradient)};
                for (int64_t j_ = 0; j_ < {plane.vectors * LANES}; j_ += {LANES}) {{
                    const nf_wv g_ = *(const nf_wv *)(gradient_ + j_);
                    const float *src_ = plane_ + v_{rows.position} * {rows.stride * plane.pitch} + j_;
                    {newline.join(accumulate)}
                }}
            }}
        }}
        float sums_[{plane.taps}];
        {sums}
        {tap_loops} {{
            const float acc_ = sums_[{tap}];
            out[{target}] = (float)({printer(plan.epilogue)});
        }}
    }}
}}
"""
