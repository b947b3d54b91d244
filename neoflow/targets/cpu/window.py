"""Depthwise convolutions and their input adjoints: each plane padded once, rows summed in vectors.

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
then finished by the epilogue and stored once: 0.73 ms for that one.

``window_plan`` recognises the form: a ``ReduceAdd`` of a product of a *plane* operand and a
*tap* operand, where the plane operand reads (through point-wise prologues of reads at the
same indices, applied once per copied element) one tensor whose last two indices are
``stride * h + a * r + c`` and ``stride * w + b * s + d`` (``h``, ``w`` the output's last two
indices, ``r``, ``s`` reduction axes, strides 1 or 2) and whose other indices name the plane
from the output's other indices; the tap operand does not read ``h`` or ``w``; the sum's
domain condition (or the padding guard ``guards_to_domain`` moves there) is exactly the
plane read's bounds; every other reduction axis has extent one.  The autodiff's input adjoint
of a stride-1 depthwise convolution (``G[n, c, z - r + 1, ...]``) has the same form.
``window_function`` emits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import sympy

from neoflow.codegen.c_expr import IndexPrinter, ValuePrinter
from neoflow.codegen.implicit_gemm import guards_to_domain
from neoflow.codegen.lattice import product_sum
from neoflow.ir import index
from neoflow.ir.expr import Binary, Cast, Const, Expr, Index, Read, Reduce, Unary, index_variables, map_children
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
#: the largest window (taps) taken: beyond it a sum per point is long enough for the loop nest
MAX_TAPS = 49
#: the variable names of a copied element's row and column in the plane's tensor
ROW, COL = "nf_iy", "nf_ix"


@dataclass(frozen=True)
class Axis:
    """One of the plane's two dimensions: the output index ``out`` (``extent`` points) read at
    ``stride * out + coefficient * tap + offset`` of a dimension of ``size`` elements; ``tap`` is
    the reduction axis (``taps`` values) or None where the dimension takes none."""

    out: str
    extent: int
    stride: int
    tap: str | None
    taps: int
    coefficient: int
    offset: int
    size: int

    @property
    def highest(self) -> int:
        """The highest element any point and tap reads (at ``size`` or beyond: padding)."""
        return self.stride * (self.extent - 1) + self.offset + max(0, self.coefficient * (self.taps - 1))

    @property
    def lowest(self) -> int:
        """The lowest element any point and tap reads (below zero: padding)."""
        return self.offset + min(0, self.coefficient * (self.taps - 1))

    def shift(self, tap: int) -> int:
        """Where tap ``tap`` reads for output 0, counted from ``lowest``."""
        return self.coefficient * tap + self.offset - self.lowest


@dataclass(frozen=True)
class WindowPlan:
    """``op`` (its padding guard moved into the sum's domain, its unit reduction axes set to 0) as
    ``epilogue(sum over the taps of plane * weight)``: ``plane`` is the plane operand read at the
    copied element (its reads' last two indices ``ROW`` and ``COL``), ``weight`` the tap's factor; ``rows``,
    ``cols`` the two dimensions; ``outer`` the output's other indices."""

    op: Op
    plane: Expr
    weight: Expr
    rows: Axis
    cols: Axis
    outer: tuple[tuple[str, int], ...]
    epilogue: Expr | None

    @property
    def vectors(self) -> int:
        """Vectors an output row is summed in."""
        return -(-self.cols.extent // LANES)

    @property
    def pitch(self) -> int:
        """Floats a row of one column phase of the plane buffer holds: every vector every tap reads."""
        widest = max(self.cols.shift(t) for t in range(self.cols.taps)) // self.cols.stride
        return self.vectors * LANES + widest

    @property
    def plane_rows(self) -> int:
        """Rows of the plane buffer: every row a point and tap reads."""
        rows = self.rows
        return rows.stride * (rows.extent - 1) + max(rows.shift(t) for t in range(rows.taps)) + 1

    @property
    def plane_floats(self) -> int:
        return self.cols.stride * self.plane_rows * self.pitch


def _affine_parts(expr: sympy.Expr, out: str, taps: set[str]) -> tuple[int, str | None, int, int] | None:
    """``(stride, tap, coefficient, offset)`` of ``expr = stride * out + coefficient * tap + offset``
    with integers and at most one of ``taps``; None for any other expression."""
    symbols = {s.name for s in expr.free_symbols}
    used = symbols & taps
    if not symbols <= {out} | taps or len(used) > 1 or out not in symbols:
        return None
    if not expr.is_polynomial(*expr.free_symbols):
        return None  # a division or modulo (a strided adjoint's parity)
    poly = sympy.Poly(expr, *[index.var(v) for v in sorted(symbols)])
    if poly.total_degree() > 1 or not all(c.is_Integer for c in poly.coeffs()):
        return None
    stride = int(expr.coeff(index.var(out)))
    tap = next(iter(used), None)
    coefficient = int(expr.coeff(index.var(tap))) if tap else 0
    offset = _constant(expr)
    if stride not in STRIDES or (tap is not None and coefficient == 0):
        return None
    return stride, tap, coefficient, offset


def _bounds(cond: Expr | None) -> dict[sympy.Expr, list[int]] | None:
    """Each index expression's ``[low, high]`` bounds a conjunction of comparisons with constants sets
    (``{}`` for no condition); None for any other condition."""
    found: dict[sympy.Expr, list[int]] = {}
    if cond is None:
        return found
    stack = [cond]
    while stack:
        node = stack.pop()
        if isinstance(node, Binary) and node.op == "&&":
            stack += [node.a, node.b]
            continue
        if not (isinstance(node, Binary) and node.op in ("<", "<=", ">", ">=")):
            return None
        if not (isinstance(node.a, Index) and isinstance(node.b, Const) and isinstance(node.b.value, int)):
            return None
        expr, value = node.a.expr, node.b.value
        constant = _constant(expr)
        expr, value = expr - constant, value - constant
        low, high = found.setdefault(expr, [-math.inf, math.inf])
        if node.op in (">", ">="):
            found[expr][0] = max(low, value + (node.op == ">"))
        else:
            found[expr][1] = min(high, value - (node.op == "<"))
    return found


def _same_indices_reads(expr: Expr) -> list[Read] | None:
    """The reads of a point-wise ``expr`` (no reduction) where all read the same indices, else None."""
    reads = [n for n in expr.walk() if isinstance(n, Read)]
    if not reads or any(isinstance(n, Reduce) for n in expr.walk()):
        return None
    if any(r.indices != reads[0].indices for r in reads):
        return None
    if not all(isinstance(n, (Read, Binary, Unary, Cast, Const)) for n in expr.walk()):
        return None
    return reads


def _substitute(expr: Expr, values: dict) -> Expr:
    """``expr`` with index variables replaced (``values``: sympy symbol -> expression)."""

    def put(node: Expr) -> Expr:
        if isinstance(node, Read):
            return Read(node.tensor, tuple(sympy.sympify(i).subs(values) for i in node.indices), node.tensor_dtype)
        if isinstance(node, Index):
            return Index(node.expr.subs(values))
        return map_children(node, put)

    return put(expr)


def window_form(op: Op) -> WindowPlan | None:
    """The ``WindowPlan`` of ``op``, or None where it has not the form (module docstring)."""
    if op.scatter is not None or op.dtype != "float32" or len(op.indices) < 2:
        return None
    if any(t.dtype != "float32" for t in op.inputs):
        return None
    parts = product_sum(guards_to_domain(op, lattice_only=False))
    if parts is None:
        return None
    reduce, epilogue, product = parts
    extent = op.extent
    unit = {index.var(a): 0 for a in reduce.axes if extent[a] == 1}
    taps = {a for a in reduce.axes if extent[a] > 1}
    if len(taps) > 2 or math.prod(extent[a] for a in taps) > MAX_TAPS:
        return None
    factors = [_substitute(product.a, unit), _substitute(product.b, unit)]
    h, w = op.indices[-2:]
    outer = tuple((v, extent[v]) for v in op.indices[:-2])
    planar = [k for k, f in enumerate(factors) if {h, w} & index_variables(f)]
    if len(planar) != 1:
        return None
    plane, weight = factors[planar[0]], factors[1 - planar[0]]
    reads = _same_indices_reads(plane)
    if reads is None or (len({r.tensor for r in reads}) > 1 and _shapes_differ(op, reads)):
        return None
    indices = [sympy.sympify(i) for i in reads[0].indices]
    if len(indices) < 2:
        return None
    shape = next(t.shape for t in op.inputs if t.name == reads[0].tensor)
    axes = []
    for position, out in ((-2, h), (-1, w)):
        found = _affine_parts(indices[position], out, taps)
        if found is None:
            return None
        stride, tap, coefficient, offset = found
        axes.append(
            Axis(out, extent[out], stride, tap, extent[tap] if tap else 1, coefficient, offset, shape[position])
        )
    rows, cols = axes
    if (rows.tap == cols.tap and rows.tap is not None) or {a.tap for a in axes} - {None} != taps:
        return None
    outer_names = {v for v, _ in outer}
    if any({s.name for s in i.free_symbols} - outer_names for i in indices[:-2]):
        return None
    if {h, w} & index_variables(weight):
        return None
    where = None if reduce.where is None else _substitute(reduce.where, unit)
    bounds = _bounds(where)
    if bounds is None or not _exactly_in_bounds(bounds, indices[-2:], axes):
        return None
    plan = WindowPlan(op, _with_plane_indices(plane, len(indices)), weight, rows, cols, outer, epilogue)
    if plan.plane_floats > MAX_PLANE_FLOATS:
        return None
    return plan


def _shapes_differ(op: Op, reads: list[Read]) -> bool:
    shapes = {t.name: t.shape for t in op.inputs}
    return len({shapes[r.tensor] for r in reads}) > 1


def _with_plane_indices(plane: Expr, rank: int) -> Expr:
    """``plane`` reading each tensor at its own indices but the last two, which become ``ROW``, ``COL``."""

    def put(node: Expr) -> Expr:
        if isinstance(node, Read):
            return Read(node.tensor, (*node.indices[: rank - 2], index.var(ROW), index.var(COL)), node.tensor_dtype)
        return map_children(node, put)

    return put(plane)


def _exactly_in_bounds(bounds: dict, indices: list[sympy.Expr], axes: list[Axis]) -> bool:
    """Whether the sum's domain condition (``bounds``, by index expression less its constant) keeps
    exactly the terms whose plane read lies in the tensor: an index that may leave it bounded to
    exactly the tensor, one that never does bounded so or not at all, nothing else bounded."""
    keys = []
    for expr, axis in zip(indices, axes, strict=True):
        constant = _constant(expr)
        key, exact = expr - constant, [-constant, axis.size - 1 - constant]
        found = bounds.get(key)
        inside = axis.lowest >= 0 and axis.highest < axis.size
        if (found is None and not inside) or (found is not None and found != exact):
            return False
        keys.append(key)
    return set(bounds) <= set(keys)


def _constant(expr: sympy.Expr) -> int:
    return int(expr.subs({s: 0 for s in expr.free_symbols}))


@lru_cache(maxsize=1024)
def window_plan(op: Op) -> WindowPlan | None:
    """``window_form`` of ``op`` (cached: the lowering and the fusion cost model both ask)."""
    return window_form(op)


def window_function(op: Op, plan: WindowPlan, name: str) -> str:
    """The C function ``name`` computing ``op`` by ``plan``: per output plane (in parallel) the
    plane copied into a zero-bordered buffer by column phase, the taps' factors, then each row
    summed in blocks of vectors and finished by the epilogue."""
    tensors = {t.name: t for t in op.inputs}
    names = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
    extents = dict(op.extent) | {ROW: plan.rows.size, COL: plan.cols.size}
    index_printer = IndexPrinter(lambda v: f"v_{v}", lambda t, idx: values.read(t, idx))
    values = ValuePrinter(tensors, names, index_printer, lambda node: "acc_", extents)
    rows, cols = plan.rows, plan.cols
    phases, pitch, plane_rows = cols.stride, plan.pitch, plan.plane_rows
    outer_points = math.prod(e for _, e in plan.outer)
    decode = []
    rest = "p_"
    for v, e in reversed(plan.outer):
        decode.append(f"const int64_t v_{v} = {rest} % {e};")
        rest = f"({rest} / {e})"
    copy_value = values(plan.plane, "float32")
    row_tap = f"v_{rows.tap}" if rows.tap else "0"
    col_tap = f"v_{cols.tap}" if cols.tap else "0"
    tap_loops = []
    for tap in (rows.tap, cols.tap):
        if tap:
            tap_loops.append(f"for (int64_t v_{tap} = 0; v_{tap} < {op.extent[tap]}; ++v_{tap})")
    weight_index = f"{row_tap} * {cols.taps} + {col_tap}"
    weights = f"""float k_[{rows.taps * cols.taps}];
            {" ".join(tap_loops)} k_[{weight_index}] = {values(plan.weight, "float32")};"""
    blocks = []
    for first in range(0, plan.vectors, BLOCK_VECTORS):
        count = min(BLOCK_VECTORS, plan.vectors - first)
        zeros = ", ".join(f"a{j} = {{0}}" for j in range(count))
        adds = " ".join(f"a{j} += k * *(const nf_wv *)(src + {(first + j) * LANES});" for j in range(count))
        stores = " ".join(f"*(nf_wv *)(row_ + {(first + j) * LANES}) = a{j};" for j in range(count))
        blocks.append(f"""{{
                nf_wv {zeros};
                for (int64_t t_ = 0; t_ < {rows.taps * cols.taps}; ++t_) {{
                    const float k = k_[t_];
                    const float *src = plane_ + tap_[t_] + (int64_t)v_{rows.out} * {rows.stride * pitch};
                    {adds}
                }}
                {stores}
            }}""")
    epilogue = values(plan.epilogue, "float32") if plan.epilogue is not None else "acc_"
    deinterleave = ""
    if phases > 1:  # column phase q_ holds columns q_, q_ + phases, ...: each tap then reads consecutive elements
        deinterleave = f"""for (int64_t q_ = 0; q_ < {phases}; ++q_)
                for (int64_t x_ = 0; x_ < {pitch}; ++x_)
                    plane_[(q_ * {plane_rows} + y_) * {pitch} + x_] = row_line_[x_ * {phases} + q_];"""
    parallel = "#pragma omp parallel for" if outer_points * rows.extent * cols.extent >= PARALLEL_MIN_POINTS else ""
    row_lowest, col_lowest = rows.lowest, cols.lowest
    return f"""typedef float nf_wv __attribute__((vector_size({LANES * 4}), aligned(4)));
void {name}(float *restrict out{"".join(f", const float *restrict in{k}" for k in range(len(op.inputs)))}) {{
    /* where each tap's sum starts in the plane buffer (its column phase, row and column), for output row 0 */
    int64_t tap_[{rows.taps * cols.taps}];
    for (int64_t r_ = 0; r_ < {rows.taps}; ++r_)
        for (int64_t s_ = 0; s_ < {cols.taps}; ++s_) {{
            const int64_t x_ = {cols.coefficient} * s_ + {cols.offset - col_lowest};
            const int64_t y_ = {rows.coefficient} * r_ + {rows.offset - row_lowest};
            tap_[r_ * {cols.taps} + s_] = ((x_ % {phases}) * {plane_rows} + y_) * {pitch} + x_ / {phases};
        }}
    {parallel}
    for (int64_t p_ = 0; p_ < {outer_points}; ++p_) {{
        {" ".join(decode)}
        NF_SCRATCH(float, plane_, {plan.plane_floats});
        float row_[{plan.vectors * LANES}] __attribute__((aligned(32))), row_line_[{phases * pitch}];
        for (int64_t y_ = 0; y_ < {plane_rows}; ++y_) {{
            const int64_t v_{ROW} = y_ + {row_lowest};
            const int inside_ = v_{ROW} >= 0 && v_{ROW} < {rows.size};
            float *line_ = {"plane_ + y_ * " + str(pitch) if phases == 1 else "row_line_"};
            for (int64_t x_ = 0; x_ < {phases * pitch}; ++x_) {{
                const int64_t v_{COL} = x_ + {col_lowest};
                line_[x_] = inside_ && v_{COL} >= 0 && v_{COL} < {cols.size} ? {copy_value} : 0.0f;
            }}
            {deinterleave}
        }}
        {weights}
        float *out_ = out + p_ * {rows.extent * cols.extent};
        for (int64_t v_{rows.out} = 0; v_{rows.out} < {rows.extent}; ++v_{rows.out}) {{
            {"".join(blocks)}
            #pragma omp simd
            for (int64_t v_{cols.out} = 0; v_{cols.out} < {cols.extent}; ++v_{cols.out}) {{
                const float acc_ = row_[v_{cols.out}];
                out_[v_{rows.out} * {cols.extent} + v_{cols.out}] = (float)({epilogue});
            }}
        }}
    }}
}}
"""
