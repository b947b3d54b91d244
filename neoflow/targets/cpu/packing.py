"""Packers for the blocked kernel's operands that read through offset tables.

The blocked kernel (``neoflow.targets.cpu.gemm``) copies blocks of each operand into
contiguous strips before the micro-kernel streams them.  When the operand is a
read at an affine index, guarded by affine bounds (the padding of a convolution:
``Select(0 <= p + r - 1 < 56 && ..., X[n, c, p + r - 1, q + s - 1], 0)``), every
quantity the packer needs is a sum of a part that depends on the strip's side
(the rows or the columns), a part that depends on the depth and a part that
depends on the batch.  The side and depth parts are tabulated once per call; the
packer then adds two table entries per quantity, compares each guarded
quantity with its range in one unsigned comparison and reads the element,
instead of decoding every index variable and evaluating the read expression at
each element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import sympy

from neoflow.codegen.c_expr import IndexPrinter, unflatten_index
from neoflow.ir.expr import Binary, Const, Expr, Index, Read, Select, conjuncts
from neoflow.ir.index import coefficient
from neoflow.ir.simplify import read_offset
from neoflow.targets.cpu.tables import Table

_FLIP = {">=": "<=", ">": "<", "<=": ">=", "<": ">"}
#: strips this wide (two AVX2 vectors) are copied with vector loads where the read runs along them
VECTOR_WIDTH = 16
GATHER_STEP_LIMIT = 1 << 26  # a strided strip is gathered when 15 steps fit an int32 lane
#: rows transposed together by the depth-run packer, by strip width
_GROUP = {6: 6, 16: 8}
#: the shortest run along the depth a packer copies with vector loads: four steps (a 4x4 pose's last
#: axis in a capsule convolution) fill half of each 8-lane load and half the transposed rows
HALF_RUN = 4


@dataclass(frozen=True)
class Strips:
    """What a packer copies: the side (rows or columns) and depth variables, row-major,
    the extents of the op's variables and the size of the tensor it reads."""

    side: tuple[str, ...]
    depth: tuple[str, ...]
    extents: dict[str, int]
    tensor_size: int


@dataclass(frozen=True)
class Range:
    """``low <= linear <= high`` (either bound may be missing) for a linear index expression."""

    linear: sympy.Expr
    low: int | None
    high: int | None


@dataclass(frozen=True)
class AffineOperand:
    """An operand ``Select(guards, clamps(tensor[index]), 0)`` whose flat offset and guards
    are affine; ``clamps`` (``("max", 0.0)`` for a ReLU inlined into its reader) are
    applied to the value read, innermost first, and each keeps zero at zero, so a lane
    the guards zero stays zero."""

    tensor: str
    offset: sympy.Expr
    ranges: tuple[Range, ...]
    clamps: tuple[tuple[str, float], ...] = ()

    def quantities(self) -> list[sympy.Expr]:
        """The tabulated quantities: the read's offset, then each range's expression
        shifted so that its bound is zero (its low bound when it has one)."""
        shifted = [r.linear - (r.low if r.low is not None else r.high) for r in self.ranges]
        return [self.offset, *shifted]


def affine_operand(
    factor: Expr, shapes: dict[str, tuple[int, ...]], extents: Mapping[str, int]
) -> AffineOperand | None:
    """``factor`` as an affine guarded read, or None when it is anything else (a prologue
    computing values, a data-dependent index, a guard that is not a bound on an affine
    index expression).  The read's offset is simplified over the box of the op's
    variables' ``extents``: a reshape's digits add back up to its flat index."""
    guards: list[Expr] = []
    while isinstance(factor, Select):
        if not (isinstance(factor.b, Const) and factor.b.value == 0):
            return None
        guards.extend(conjuncts(factor.cond))
        factor = factor.a
    clamps: list[tuple[str, float]] = []
    while (clamp := _clamp(factor)) is not None:
        clamps.insert(0, clamp[0])
        factor = clamp[1]
    if not isinstance(factor, Read) or factor.tensor_dtype != "float32":
        return None
    offset = read_offset(factor.indices, shapes[factor.tensor], extents)
    if not _is_linear(offset):
        return None
    bounds: dict[sympy.Expr, list[int | None]] = {}
    for guard in guards:
        bound = _bound(guard)
        if bound is None:
            return None
        linear, low, high = bound
        entry = bounds.setdefault(linear, [None, None])
        if low is not None:
            entry[0] = low if entry[0] is None else max(entry[0], low)
        if high is not None:
            entry[1] = high if entry[1] is None else min(entry[1], high)
    ranges = tuple(Range(linear, low, high) for linear, (low, high) in bounds.items())
    return AffineOperand(factor.tensor, offset, ranges, tuple(clamps))


def _clamp(node: Expr) -> tuple[tuple[str, float], Expr] | None:
    """``max(x, c)`` (c <= 0) or ``min(x, c)`` (c >= 0), either way round, as
    ``((kind, c), x)``: a clamp that keeps zero at zero; None for anything else."""
    if not (isinstance(node, Binary) and node.op in ("max", "min")):
        return None
    for value, other in ((node.b, node.a), (node.a, node.b)):
        if isinstance(value, Const) and isinstance(value.value, (int, float)) and not isinstance(value.value, bool):
            limit = float(value.value)
            if math.isfinite(limit) and ((limit <= 0) if node.op == "max" else (limit >= 0)):
                return (node.op, limit), other
    return None


def clamped(value: str, clamps: tuple[tuple[str, float], ...]) -> str:
    """The C float ``value`` with ``clamps`` applied (the lowering's ``NF_FMAX``/``NF_FMIN``:
    a NaN passes through, as numpy's)."""
    for kind, limit in clamps:
        value = f"NF_F{kind.upper()}({value}, {limit!r}f)"
    return value


def vector_clamped(value: str, clamps: tuple[tuple[str, float], ...]) -> str:
    """The AVX2 vector ``value`` with ``clamps`` applied; the value is the second operand,
    which ``maxps``/``minps`` return where either is NaN, so a NaN passes through."""
    for kind, limit in clamps:
        value = f"_mm256_{kind}_ps(_mm256_set1_ps({limit!r}f), {value})"
    return value


def _is_linear(expr: sympy.Expr) -> bool:
    """Whether ``expr`` is a sum of integer multiples of index variables and an integer."""
    if not expr.free_symbols:
        return expr.is_Integer
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:  # floor, Mod or a data-dependent read among the terms
        return False
    return poly.total_degree() <= 1 and all(c.is_Integer for c in poly.coeffs())


def _bound(guard: Expr) -> tuple[sympy.Expr, int | None, int | None] | None:
    """A guard ``a OP b`` (integer index expressions) as ``(linear, low, high)``:
    ``low <= linear <= high`` with ``linear``'s constant term removed and its first
    coefficient positive; None for any other condition."""
    if not (isinstance(guard, Binary) and guard.op in _FLIP):
        return None
    sides = []
    for side in (guard.a, guard.b):
        if isinstance(side, Index):
            sides.append(sympy.expand(side.expr))
        elif isinstance(side, Const) and isinstance(side.value, int) and not isinstance(side.value, bool):
            sides.append(sympy.Integer(side.value))
        else:
            return None
    difference = sympy.expand(sides[0] - sides[1])  # difference OP 0
    if not _is_linear(difference) or not difference.free_symbols:
        return None
    op = guard.op
    constant = int(difference.as_coeff_Add()[0])
    linear = difference - constant
    first = sympy.Poly(linear, *sorted(linear.free_symbols, key=str)).coeffs()[0]
    if first < 0:
        linear, constant, op = -linear, -constant, _FLIP[op]
    # linear + constant OP 0  <=>  linear OP -constant
    limit = -constant
    if op == ">=":
        return linear, limit, None
    if op == ">":
        return linear, limit + 1, None
    if op == "<=":
        return linear, None, limit
    return linear, None, limit - 1


def _part(expr: sympy.Expr, names: set[str], constant: bool) -> sympy.Expr:
    """The terms of linear ``expr`` in the variables ``names`` (and its constant term
    when ``constant``)."""
    terms = sympy.Add.make_args(expr)
    kept = [t for t in terms if t.free_symbols and {s.name for s in t.free_symbols} <= names]
    if constant:
        kept += [t for t in terms if not t.free_symbols]
    return sympy.Add(*kept)


def operand_tables(name: str, operand: AffineOperand, variables: list[tuple[str, int]], first_depth: bool) -> Table:
    """``<name>[q]`` (one ``int64_t`` table per quantity of ``operand``) with entry ``f``
    the part of each quantity in ``variables`` at their ``f``-th point (row-major); the
    depth tables (``first_depth``) carry the constant terms."""
    names = {v for v, _ in variables}
    size = math.prod(extent for _, extent in variables)
    printer = IndexPrinter(lambda v: f"v_{v}", _no_data_reads)
    quantities = operand.quantities()
    stores = " ".join(
        f"{name}[{q}][f] = {printer(_part(expr, names, first_depth))};" for q, expr in enumerate(quantities)
    )
    return Table(
        f"static int64_t *{name}[{len(quantities)}];",
        f"for (int q = 0; q < {len(quantities)}; ++q)\n"
        f"    {name}[q] = (int64_t *)malloc(sizeof(int64_t) * {max(size, 1)});\n"
        f"for (int64_t f = 0; f < {size}; ++f) {{ {unflatten_index('f', variables)} {stores} }}",
    )


def batch_base(quantity: sympy.Expr, batch: list[tuple[str, int]]) -> str:
    """C for the part of an operand's ``quantity`` (its read offset, a guarded expression)
    in the ``batch`` variables (read as ``v_<name>``)."""
    printer = IndexPrinter(lambda v: f"v_{v}", _no_data_reads)
    return printer(_part(quantity, {v for v, _ in batch}, False))


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (a packed buffer's rows or strips)."""
    return -(-value // multiple) * multiple


def affine_packer(
    name: str,
    width: int,
    operand: AffineOperand,
    tensor_name: str,
    batch: list[tuple[str, int]],
    side_inner: bool,
    params: str,
    strips: Strips,
) -> str:
    """A C function with the generic packer's contract (``gemm._packer``) for an affine
    operand: strips ``width`` wide of rows (or columns) ``[start, start + size)`` and
    depth ``[pc, pc + kc)``, the outer loop over ``[lo, hi)``, reading through the side
    tables ``side[q]`` and depth tables ``dep[q]`` of ``operand_tables``.  With AVX2,
    where ``vector_path`` says so, runs of consecutive reads are copied with vector
    loads, each lane masked by the guards: along a ``VECTOR_WIDTH``-wide strip
    (``_side_runs``) or along the depth, 8 steps of a few rows at a time, transposed
    in registers (``_depth_runs``)."""
    quantities = operand.quantities()
    bases = " ".join(f"const int64_t base{q}_ = {batch_base(expr, batch)};" for q, expr in enumerate(quantities))

    def element(side: str, depth: str) -> str:
        """The packed value, with quantity ``q`` = ``side(q) + depth(q)``."""
        checks = [
            _in_range(r, f"({side.format(q=q)} + {depth.format(q=q)})") for q, r in enumerate(operand.ranges, start=1)
        ]
        read = clamped(f"{tensor_name}[{side.format(q=0)} + {depth.format(q=0)}]", operand.clamps)
        return f"({' && '.join(checks)}) ? {read} : 0.0f" if checks else read

    def declare(template: str) -> str:
        """``template`` (a C declaration of quantity ``{q}``) for every quantity."""
        return " ".join(template.format(q=q) for q in range(len(quantities)))

    header = f"""static NF_SCALAR void {name}(float *restrict buffer, int64_t start, int64_t size, int64_t pc,
        int64_t kc, int64_t lo, int64_t hi, int64_t *const *side, int64_t *const *dep{params}) {{
    {bases}"""
    if side_inner:
        # a strip whose read offsets are consecutive and whose guarded quantities are arithmetic
        # sequences is a run: where both ends pass every guard, all of it does, and it is one copy
        steps = " && ".join(
            f"s{q}_[s + ii] - s{q}_[s] == ii * (s{q}_[s + 1] - s{q}_[s])" for q in range(1, len(quantities))
        )
        arithmetic = f"s0_[s + ii] == s0_[s] + ii{' && ' + steps if steps else ''}"
        copy = f"memcpy(strip, {tensor_name} + s0_[s] + d0_, sizeof(float) * {width});"
        if operand.clamps:
            source = clamped(f"{tensor_name}[s0_[s] + d0_ + ii]", operand.clamps)
            copy = f"for (int64_t ii = 0; ii < {width}; ++ii) strip[ii] = {source};"
        end_checks = _end_checks(operand.ranges, width)
        scalar = f"""{header}
    {declare("const int64_t *restrict s{q}_ = side[{q}] + start;")}
    const int64_t strips = (size + {width - 1}) / {width};
    char run[strips > 0 ? strips : 1];
    for (int64_t s = 0; s < size; s += {width}) {{
        int ok = size - s >= {width};
        for (int64_t ii = 1; ok && ii < {width}; ++ii) ok = {arithmetic};
        run[s / {width}] = (char)ok;
    }}
    for (int64_t p = lo; p < hi; ++p) {{
        {declare("const int64_t d{q}_ = dep[{q}][pc + p] + base{q}_;")}
        float *restrict row = buffer + p * {width};
        for (int64_t s = 0; s < size; s += {width}) {{
            float *restrict strip = row + s * kc;
            if (run[s / {width}]{end_checks}) {{
                {copy}
                continue;
            }}
            const int64_t n = size - s < {width} ? size - s : {width};
            for (int64_t ii = 0; ii < n; ++ii)
                strip[ii] = {element("s{q}_[s + ii]", "d{q}_")};
        }}
    }}
}}"""
    else:
        scalar = f"""{header}
    {declare("const int64_t *restrict d{q}_ = dep[{q}] + pc;")}
    for (int64_t i = lo; i < hi; ++i) {{
        {declare("const int64_t s{q}_ = side[{q}][start + i] + base{q}_;")}
        float *restrict column = buffer + (i / {width}) * {width} * kc + i % {width};
        for (int64_t p = 0; p < kc; ++p)
            column[p * {width}] = {element("s{q}_", "d{q}_[p]")};
    }}
}}"""
    path = vector_path(operand, width, side_inner, strips)
    if path is None:
        return scalar
    if path == "side":
        vector = _side_runs(header, operand, tensor_name, strips.tensor_size, declare, element)
    else:
        vector = _depth_runs(header, operand, tensor_name, width, side_inner, strips.tensor_size, declare, element)
    return f"#if defined(__AVX2__)\n{vector}\n#else\n{scalar}\n#endif"


def vector_path(operand: AffineOperand | None, width: int, side_inner: bool, strips: Strips) -> str | None:
    """How the packer of ``operand`` copies with vector loads: ``"side"`` (each
    ``VECTOR_WIDTH``-wide strip whose reads are consecutive, for a side-inner packer),
    ``"depth"`` (8 or 4 consecutive depth steps of a group of rows, where the innermost
    depth variables read runs of at least ``_shortest_run``) or None (element by element)."""
    if operand is None or not _lanes_fit(operand, strips.extents):
        return None
    if side_inner and width == VECTOR_WIDTH and vector_runs(operand, strips.side, strips.extents):
        return "side"
    if width in _GROUP and _run_span(operand, strips.depth, strips.extents) >= _shortest_run(side_inner):
        return "depth"
    if side_inner and width == VECTOR_WIDTH:
        return "side"  # strips may still be runs here and there: the packer checks each one
    return None


def vector_fraction(operand: AffineOperand | None, width: int, side_inner: bool, strips: Strips) -> float:
    """The share of the elements ``vector_path`` copies with vector loads: the full
    strips of a ``"side"`` path along consecutive reads, the full 8-step (then 4-step)
    depth chunks of a ``"depth"`` path (0 otherwise)."""
    path = vector_path(operand, width, side_inner, strips)
    if path is None or operand is None:
        return 0.0
    if path == "side":
        if not vector_runs(operand, strips.side, strips.extents):
            return 0.0
        size = math.prod(strips.extents[v] for v in strips.side)
        return size // width * width / size
    span = _run_span(operand, strips.depth, strips.extents)
    shortest = _shortest_run(side_inner)
    return (span // 8 * 8 + span % 8 // shortest * shortest) / span


def _shortest_run(side_inner: bool) -> int:
    """The shortest run along the depth a ``"depth"`` path copies: ``HALF_RUN`` for a side-outer
    packer; 8 for a side-inner one, whose ``"side"`` path serves shorter runs better (its strips'
    constant steps)."""
    return 8 if side_inner else HALF_RUN


def gather_fraction(operand: AffineOperand | None, width: int, side_inner: bool, strips: Strips) -> float:
    """The share of the elements a ``"side"`` packer gathers: those of the full strips
    that lie within one run of reads a constant step (other than one) apart."""
    if vector_path(operand, width, side_inner, strips) != "side" or operand is None:
        return 0.0
    if vector_runs(operand, strips.side, strips.extents):
        return 0.0
    span, step = _stride_span(operand, strips.side, strips.extents)
    if step in (0, 1) or abs(step) >= GATHER_STEP_LIMIT or span < width:
        return 0.0
    size = math.prod(strips.extents[v] for v in strips.side)
    # strips start every ``width`` elements, runs every ``span``: the pattern repeats every lcm of the two
    counted = min(size // width, math.lcm(span, width) // width)
    inside = sum(1 for j in range(counted) if (j * width) // span == (j * width + width - 1) // span)
    return inside / counted * (size // width * width) / size if counted else 0.0


def gather_step(operand: AffineOperand | None, strips: Strips) -> int:
    """How many elements apart a ``"side"`` packer's gathered reads lie (0 where not constant):
    a step of two is compacted with two loads and a permute on AVX-512 (``nf_load_pairs``)."""
    return 0 if operand is None else _stride_span(operand, strips.side, strips.extents)[1]


def _stride_span(operand: AffineOperand, variables: tuple[str, ...], extents: dict[str, int]) -> tuple[int, int]:
    """``_run_span`` for reads a constant step apart: how many elements ``operand`` reads
    along the flattened ``variables`` one ``step`` apart before its offset jumps, and the step
    (the last variable's coefficient; 0 where it is not a constant)."""
    if not variables:
        return 1, 0
    last = coefficient(operand.offset, variables[-1])
    if not last.is_Integer or last == 0:
        return 1, 0
    step, span = int(last), 1
    for name in reversed(variables):
        if coefficient(operand.offset, name) != step:
            break
        span *= extents[name]
        step *= extents[name]
    return span, int(last)


def vector_runs(operand: AffineOperand | None, side: tuple[str, ...], extents: dict[str, int]) -> bool:
    """Whether the vector packer copies every full strip of ``operand`` along the ``side``
    variables (row-major, the last fastest) with vector loads: the read is affine, its
    offset moves by one element per step of the flattened side, and its guarded
    quantities fit 32-bit lanes."""
    if operand is None or not side or not _lanes_fit(operand, extents):
        return False
    return _run_span(operand, side, extents) == math.prod(extents[v] for v in side)


def _run_span(operand: AffineOperand, variables: tuple[str, ...], extents: dict[str, int]) -> int:
    """How many consecutive elements ``operand`` reads along the flattened ``variables``
    before its offset jumps: the extents' product over the longest row-major suffix
    whose offset moves by one element per step (1 when the last variable does not)."""
    span, step = _stride_span(operand, variables, extents)
    return span if step == 1 else 1


def _lanes_fit(operand: AffineOperand, extents: dict[str, int]) -> bool:
    """Whether every guarded quantity of ``operand`` stays within 32 bits over the
    variables' ``extents`` (the vector packer compares it lane by lane as ``int32``)."""
    names = sorted({s.name for q in operand.quantities()[1:] for s in q.free_symbols})
    return _lanes_fit_over(operand, tuple((name, extents.get(name, 1 << 31)) for name in names))


@lru_cache(maxsize=1024)
def _lanes_fit_over(operand: AffineOperand, variables: tuple[tuple[str, int], ...]) -> bool:
    """``_lanes_fit`` for the extents of the variables its quantities use (cached)."""
    extents = dict(variables)
    for quantity in operand.quantities()[1:]:
        constant, terms = sympy.expand(quantity).as_coeff_Add()
        reach = abs(int(constant)) + sum(
            abs(int(term.as_coeff_Mul()[0])) * (extents.get(term.free_symbols.pop().name, 1 << 31) - 1)
            for term in sympy.Add.make_args(terms)
            if term.free_symbols
        )
        if reach >= 1 << 30:
            return False
    return True


def _side_runs(
    header: str,
    operand: AffineOperand,
    tensor_name: str,
    tensor_size: int,
    declare: Callable[[str], str],
    element: Callable[[str, str], str],
) -> str:
    """The AVX2 body of the side-inner packer for ``VECTOR_WIDTH``-wide strips: strip
    by strip (each written contiguously), a strip whose read offsets are consecutive is
    copied with two 8-lane loads per depth step, each lane zeroed where a guarded
    quantity (side part as an ``int32`` lane plus the depth part) leaves its range;
    a plain load where the whole strip lies inside the tensor (a masked load, which
    never touches the masked lanes, at its edges); a strip whose offsets are a
    constant step apart with two masked gathers, or, a step of two inside the tensor
    on AVX-512, two loads and a permute (``nf_load_pairs``, gathers are slow); other
    strips element by element."""
    guards = list(enumerate(operand.ranges, start=1))
    lanes = "\n".join(
        f"            for (int ii = 0; ii < {VECTOR_WIDTH}; ++ii) g{q}[ii] = (int32_t)s{q}_[s + ii];\n"
        f"            const __m256i g{q}a = _mm256_loadu_si256((const __m256i *)g{q}), "
        f"g{q}b = _mm256_loadu_si256((const __m256i *)(g{q} + 8));"
        for q, _ in guards
    )
    arrays = " ".join(f"int32_t g{q}[{VECTOR_WIDTH}];" for q, _ in guards)

    def mask(half: str) -> str:
        return _all_lanes([_lane_check(bound, f"_mm256_add_epi32(g{q}{half}, e{q})") for q, bound in guards])

    depth_lanes = " ".join(
        f"const __m256i e{q} = _mm256_set1_epi32((int32_t)(dep[{q}][pc + p] + base{q}_));" for q, _ in guards
    )
    plain, skip_plain = "", ""
    if not guards and not operand.clamps:
        plain = _plain_strips(tensor_name, tensor_size)
        skip_plain = f"""
        if (plain[s / {VECTOR_WIDTH}]) continue;"""
    return f"""{header}
    {declare("const int64_t *restrict s{q}_ = side[{q}] + start;")}
    {arrays}{plain}
    for (int64_t s = 0; s < size; s += {VECTOR_WIDTH}) {{{skip_plain}
        float *restrict strip = buffer + s * kc;
        int run = size - s >= {VECTOR_WIDTH};
        const int64_t step_ = run ? s0_[s + 1] - s0_[s] : 0;
        for (int64_t ii = 2; run && ii < {VECTOR_WIDTH}; ++ii) run = s0_[s + ii] == s0_[s] + ii * step_;
        if (run && step_ != 0 && step_ < {GATHER_STEP_LIMIT} && step_ > -{GATHER_STEP_LIMIT}) {{
{lanes}
            const __m256i ia = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                  _mm256_set1_epi32((int32_t)step_));
            const __m256i ib = _mm256_add_epi32(ia, _mm256_set1_epi32((int32_t)(8 * step_)));
            for (int64_t p = lo; p < hi; ++p) {{
                {depth_lanes}
                const __m256i ma = {mask("a")};
                const __m256i mb = {mask("b")};
                const int64_t at = s0_[s] + dep[0][pc + p] + base0_;
                __m256 xa, xb;
#if defined(__AVX512F__)
                if (step_ == 2 && at >= 0 && at <= {tensor_size - 2 * VECTOR_WIDTH + 1}) {{
                    /* every other element: two loads and a permute, not a gather */
                    const __m512 x = nf_load_pairs({tensor_name} + at);
                    xa = _mm256_and_ps(_mm512_castps512_ps256(x), _mm256_castsi256_ps(ma));
                    xb = _mm256_and_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
                                       _mm256_castsi256_ps(mb));
                }} else
#endif
                if (step_ != 1) {{  /* reads a constant step apart: gathered, masked lanes never read */
                    const __m256 zero = _mm256_setzero_ps();
                    xa = _mm256_mask_i32gather_ps(zero, {tensor_name} + at, ia, _mm256_castsi256_ps(ma), 4);
                    xb = _mm256_mask_i32gather_ps(zero, {tensor_name} + at, ib, _mm256_castsi256_ps(mb), 4);
                }} else if (at >= 0 && at <= {tensor_size - VECTOR_WIDTH}) {{
                    xa = _mm256_and_ps(_mm256_loadu_ps({tensor_name} + at), _mm256_castsi256_ps(ma));
                    xb = _mm256_and_ps(_mm256_loadu_ps({tensor_name} + at + 8), _mm256_castsi256_ps(mb));
                }} else {{
                    xa = _mm256_maskload_ps({tensor_name} + at, ma);
                    xb = _mm256_maskload_ps({tensor_name} + at + 8, mb);
                }}
                _mm256_store_ps(strip + p * {VECTOR_WIDTH}, {vector_clamped("xa", operand.clamps)});
                _mm256_store_ps(strip + p * {VECTOR_WIDTH} + 8, {vector_clamped("xb", operand.clamps)});
            }}
            continue;
        }}
        const int64_t n = size - s < {VECTOR_WIDTH} ? size - s : {VECTOR_WIDTH};
        for (int64_t p = lo; p < hi; ++p) {{
            {declare("const int64_t d{q}_ = dep[{q}][pc + p] + base{q}_;")}
            for (int64_t ii = 0; ii < n; ++ii)
                strip[p * {VECTOR_WIDTH} + ii] = {element("s{q}_[s + ii]", "d{q}_")};
        }}
    }}
}}"""


def direct_strips(
    operand: AffineOperand, tensor_name: str, tensor_size: int, batch: list[tuple[str, int]], depth: int
) -> tuple[Table, str]:
    """C letting the micro-kernel read a side-inner operand's ``VECTOR_WIDTH``-column strip
    straight from its tensor instead of packing it (AVX-512: ``nf_micro_6x16_rows_*``, each
    depth row at its offset in the ``<side>_dep[0]`` table): a strip whose reads are
    consecutive, inside the tensor and inside every guard at every depth step reads the very
    values a packed strip would hold.  Returns the table of each depth table's lowest and
    highest entry over the ``depth`` steps (``dlo_``/``dhi_``, built once after the
    ``b_dep`` tables) and the code setting ``direct_`` (the strip's first element, or null: pack
    it) for the strip at column ``j0`` of ``span``, reading the ``b_side`` tables.  Not for
    clamped operands (a packed strip holds the clamped values)."""
    quantities = operand.quantities()
    count = len(quantities)
    extremes = Table(
        f"static int64_t dlo_[{count}], dhi_[{count}];",
        f"""for (int q = 0; q < {count}; ++q) {{
    dlo_[q] = dhi_[q] = b_dep[q][0];
    for (int64_t f = 1; f < {depth}; ++f) {{
        dlo_[q] = b_dep[q][f] < dlo_[q] ? b_dep[q][f] : dlo_[q];
        dhi_[q] = b_dep[q][f] > dhi_[q] ? b_dep[q][f] : dhi_[q];
    }}
}}""",
    )
    bases = [batch_base(quantity, batch) for quantity in quantities]
    guards = list(enumerate(operand.ranges, start=1))
    inside = "".join(
        f" && {_in_range(bound, f'(lo_[{q}] + dlo_[{q}] + {bases[q]})')}"
        f" && {_in_range(bound, f'(hi_[{q}] + dhi_[{q}] + {bases[q]})')}"
        for q, bound in guards
    )
    check = f"""const float *direct_ = 0;
                if (span == {VECTOR_WIDTH}) {{
                    /* the strip's lanes' lowest and highest value of each quantity */
                    int64_t lo_[{count}], hi_[{count}];
                    int ok_ = 1;
                    for (int q = 0; q < {count}; ++q) lo_[q] = hi_[q] = b_side[q][j0];
                    for (int64_t ii = 1; ii < {VECTOR_WIDTH}; ++ii) {{
                        ok_ = ok_ && b_side[0][j0 + ii] == b_side[0][j0] + ii;
                        for (int q = 1; q < {count}; ++q) {{
                            lo_[q] = b_side[q][j0 + ii] < lo_[q] ? b_side[q][j0 + ii] : lo_[q];
                            hi_[q] = b_side[q][j0 + ii] > hi_[q] ? b_side[q][j0 + ii] : hi_[q];
                        }}
                    }}
                    const int64_t at_ = b_side[0][j0] + {bases[0]};
                    if (ok_ && at_ + dlo_[0] >= 0 && at_ + dhi_[0] <= {tensor_size - VECTOR_WIDTH}{inside})
                        direct_ = {tensor_name} + at_;
                }}"""
    return extremes, check


def _plain_strips(tensor_name: str, tensor_size: int) -> str:
    """C copying the plain strips of an unguarded, unclamped operand first: those whose
    reads are consecutive (or, on AVX-512, every other element: ``nf_load_pairs``) and
    inside the tensor at every depth step, one vector a strip, depth step by depth step
    across all of them: a depth step's strips are neighbours in one row of the tensor,
    where strip by strip each read lies a row away from the last (the four-op input
    gradient, 64 depth steps of 16 to 64 floats: 511 -> 453 us with ``gemm.TASK_STRIPS``,
    in the step).  Leaves ``plain[s / VECTOR_WIDTH]`` (the step, 0 where not plain) for
    the strip-by-strip loop to skip.  The range check is kept although an unguarded
    read is in bounds wherever the op reads: it costs one pass over the depth table a
    call and keeps a vector load from reaching past the tensor should that ever fail."""
    return f"""
    /* the plain strips: reads 1 (or 2) apart, inside the tensor at every depth step */
    int64_t dep_low_ = 0, dep_high_ = 0;
    for (int64_t p = lo; p < hi; ++p) {{
        const int64_t d = dep[0][pc + p] + base0_;
        if (p == lo || d < dep_low_) dep_low_ = d;
        if (p == lo || d > dep_high_) dep_high_ = d;
    }}
#if defined(__AVX512F__)
    const int64_t widest_step_ = 2;
#else
    const int64_t widest_step_ = 1;
#endif
    char plain[size / {VECTOR_WIDTH} + 1];
    int any_plain = 0;
    for (int64_t s = 0; s < size; s += {VECTOR_WIDTH}) {{
        const int64_t step_ = size - s >= {VECTOR_WIDTH} && hi > lo ? s0_[s + 1] - s0_[s] : 0;
        int ok = step_ >= 1 && step_ <= widest_step_ && s0_[s] + dep_low_ >= 0
                 && s0_[s] + dep_high_ + {VECTOR_WIDTH - 1} * step_ <= {tensor_size - 1};
        for (int64_t ii = 2; ok && ii < {VECTOR_WIDTH}; ++ii) ok = s0_[s + ii] == s0_[s] + ii * step_;
        plain[s / {VECTOR_WIDTH}] = ok ? (char)step_ : 0;
        any_plain |= ok;
    }}
    for (int64_t p = lo; any_plain && p < hi; ++p) {{
        const float *restrict from = {tensor_name} + dep[0][pc + p] + base0_;
        for (int64_t s = 0; s < size; s += {VECTOR_WIDTH}) {{
            float *restrict to = buffer + s * kc + p * {VECTOR_WIDTH};
            if (plain[s / {VECTOR_WIDTH}] == 1)
                memcpy(to, from + s0_[s], sizeof(float) * {VECTOR_WIDTH});
#if defined(__AVX512F__)
            else if (plain[s / {VECTOR_WIDTH}] == 2)
                _mm512_storeu_ps(to, nf_load_pairs(from + s0_[s]));
#endif
        }}
    }}"""


def _depth_runs(
    header: str,
    operand: AffineOperand,
    tensor_name: str,
    width: int,
    side_inner: bool,
    tensor_size: int,
    declare: Callable[[str], str],
    element: Callable[[str, str], str],
) -> str:
    """The AVX2 body of a packer whose reads are consecutive along the depth: a group
    of rows (a whole 6-row strip, or half a 16-column strip) at a time, 8 depth steps
    at a time (or 4, ``HALF_RUN``, where the run is shorter: the upper lanes zero), each
    row's reads one vector load (lanes masked by the guards, the depth part of each
    guarded quantity a 32-bit lane), the group transposed in registers
    (``nf_transpose8``) and stored as rows of the strip; rows outside a full group and
    other depth steps element by element.  ``[lo, hi)`` ranges over the depth for a
    side-inner packer, over the rows otherwise."""
    group = _GROUP[width]
    guards = list(enumerate(operand.ranges, start=1))
    rows, steps = ("0", "size"), ("lo", "hi")
    if not side_inner:
        rows, steps = ("lo", "hi"), ("0", "kc")
    lanes = "NF_SCRATCH(char, run8, kc + 8); NF_SCRATCH(char, run4, kc + 8); for (int64_t p = 0; p < kc; ++p) { "
    lanes += "run8[p] = p + 8 <= kc; run4[p] = p + 4 <= kc; "
    lanes += "for (int t = 1; run4[p] && t < 4; ++t) run4[p] = dep[0][pc + p + t] == dep[0][pc + p] + t; "
    lanes += "for (int t = 1; run8[p] && t < 8; ++t) run8[p] = dep[0][pc + p + t] == dep[0][pc + p] + t; } "
    lanes += " ".join(
        f"NF_SCRATCH(int32_t, e{q}, kc + 8); "
        f"for (int64_t p = 0; p < kc; ++p) e{q}[p] = (int32_t)(dep[{q}][pc + p] + base{q}_);"
        for q, _ in guards
    )
    mask = _all_lanes(
        [
            _lane_check(bound, f"_mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(e{q} + p)), w{q})")
            for q, bound in guards
        ]
    )
    row_lanes = " ".join(f"const __m256i w{q} = _mm256_set1_epi32((int32_t)s{q}_[i + g]);" for q, _ in guards)
    if width == group:
        store = (
            f"float *to = strip + (p + t) * {width}; _mm_storeu_ps(to, _mm256_castps256_ps128(v[t])); "
            "_mm_storel_pi((__m64 *)(to + 4), _mm256_extractf128_ps(v[t], 1));"
        )
    else:
        store = f"_mm256_storeu_ps(strip + (p + t) * {width}, v[t]);"
    clamp_rows = ""
    if operand.clamps:
        clamped_row = vector_clamped("v[g]", operand.clamps)
        clamp_rows = f"for (int g = 0; g < {group}; ++g) v[g] = {clamped_row};\n                "
    return f"""{header}
    {declare("const int64_t *restrict s{q}_ = side[{q}] + start;")}
    {lanes}
    for (int64_t i = {rows[0]}; i < {rows[1]};) {{
        if (i % {group} == 0 && i + {group} <= {rows[1]}) {{
            float *restrict strip = buffer + (i / {width}) * {width} * kc + i % {width};
            int64_t p = {steps[0]};
            while (p < {steps[1]}) {{
                const int span_ = run8[p] && p + 8 <= {steps[1]} ? 8 : run4[p] && p + 4 <= {steps[1]} ? 4 : 0;
                if (!span_) {{
                    {declare("const int64_t d{q}_ = dep[{q}][pc + p] + base{q}_;")}
                    for (int g = 0; g < {group}; ++g)
                        strip[p * {width} + g] = {element("s{q}_[i + g]", "d{q}_")};
                    ++p;
                    continue;
                }}
                /* a run of four: the upper lanes masked off, never read */
                const __m256i half_ = _mm256_cmpgt_epi32(_mm256_set1_epi32(span_),
                                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                __m256 v[8];
                for (int g = 0; g < {group}; ++g) {{
                    {row_lanes}
                    const __m256i m = _mm256_and_si256({mask}, half_);
                    const int64_t at = s0_[i + g] + dep[0][pc + p] + base0_;
                    if (span_ == 8 && at >= 0 && at <= {tensor_size - 8})
                        v[g] = _mm256_and_ps(_mm256_loadu_ps({tensor_name} + at), _mm256_castsi256_ps(m));
                    else
                        v[g] = _mm256_maskload_ps({tensor_name} + at, m);
                }}
                {clamp_rows}for (int g = {group}; g < 8; ++g) v[g] = _mm256_setzero_ps();
                nf_transpose8(v);
                for (int t = 0; t < span_; ++t) {{ {store} }}
                p += span_;
            }}
            i += {group};
            continue;
        }}
        float *restrict column = buffer + (i / {width}) * {width} * kc + i % {width};
        for (int64_t p = {steps[0]}; p < {steps[1]}; ++p) {{
            {declare("const int64_t d{q}_ = dep[{q}][pc + p] + base{q}_;")}
            column[p * {width}] = {element("s{q}_[i]", "d{q}_")};
        }}
        ++i;
    }}
}}"""


def _all_lanes(checks: list[str]) -> str:
    """AVX2 mask of the lanes passing every one of ``checks`` (all lanes when there are none)."""
    mask = checks[0] if checks else "_mm256_set1_epi32(-1)"
    for check in checks[1:]:
        mask = f"_mm256_and_si256({mask}, {check})"
    return mask


def _lane_check(bound: Range, lanes: str) -> str:
    """AVX2 mask of the ``int32`` lanes (a quantity shifted so that its bound is zero) in ``bound``."""
    low = "_mm256_cmpgt_epi32(v_, _mm256_set1_epi32(-1))"
    if bound.low is not None and bound.high is not None:
        body = f"_mm256_and_si256({low}, _mm256_cmpgt_epi32(_mm256_set1_epi32({bound.high - bound.low + 1}), v_))"
    else:
        body = low if bound.low is not None else "_mm256_cmpgt_epi32(_mm256_set1_epi32(1), v_)"
    return f"({{ const __m256i v_ = {lanes}; {body}; }})"


def _end_checks(ranges: tuple[Range, ...], width: int) -> str:
    """C ``&& ...`` requiring both ends of the strip at ``s`` (quantity ``q`` = side table
    ``s{q}_`` + ``d{q}_``) to pass every guard."""
    checks = [
        _in_range(r, f"(s{q}_[{at}] + d{q}_)")
        for q, r in enumerate(ranges, start=1)
        for at in ("s", f"s + {width - 1}")
    ]
    return "".join(f" && {check}" for check in checks)


def _in_range(bound: Range, value: str) -> str:
    """C testing that ``value`` (a quantity shifted so that its bound is zero) is in ``bound``."""
    if bound.low is not None and bound.high is not None:
        return f"(uint64_t){value} <= (uint64_t){bound.high - bound.low}"
    return f"{value} >= 0" if bound.low is not None else f"{value} <= 0"


def _no_data_reads(tensor: str, indices: object) -> str:
    raise AssertionError(f"an affine operand has no data-dependent index (read of {tensor})")
