"""Contractions on the CPU's register-blocked outer-product intrinsic (BLIS-style).

For a float32 op ``Out[x] = ReduceAdd({r}, A[..] * B[..]) (+ epilogue)``, the best
``outer_product`` mapping from ``neoflow.codegen.mapping`` gives the op variables
fused onto the intrinsic's ``i`` (rows, from operand ``a``), ``j`` (columns, from
``b``) and ``k`` (the reduction), and the batch variables left outside.  The
emitted C then runs a blocked matrix product over the fused extents
``M x N x K``:

* blocks of ``b`` (``KC x NC``) and of ``a`` (``MC x KC``) are *packed* into
  contiguous strips of ``NR`` columns / ``MR`` rows; packing evaluates the op's own
  read expressions (padding guards included, out-of-range rows and columns as
  zeros), so any index map the mapper accepts is handled the same way;
* a ``MR x NR`` = 6 x 16 micro-kernel keeps its accumulators in registers (AVX-512:
  a zmm a row, two sets taking turns over the depth; AVX2 + FMA: 12 ymm; GCC vector
  extensions where neither is there) and streams the packed strips;
* results are written back through the op's output index map, and the
  epilogue (a bias, for instance) is added in the last ``KC`` block;
* the ``MC`` loop is OpenMP-parallel, each thread packing its own ``a`` block;
* the index tables the packers and the write-back read (each row's, column's and depth
  step's variables and offsets) are built by the kernel's first call and kept
  (``neoflow.targets.cpu.tables``);
* a small output with a long depth (a weight gradient) shares the depth out among the
  threads instead (``_split_depth``), and where both reads run along the depth's last
  variable it is vectorised along the depth without packing (``neoflow.targets.cpu.depth_vector``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import sympy

from neoflow.codegen.c_expr import IndexPrinter, ValuePrinter, unflatten_index
from neoflow.codegen.hardware import AVX2, AVX512
from neoflow.codegen.inner_split import split_groups
from neoflow.codegen.lattice import Piece, product_sum, split_epilogue, split_lattice, with_reduce
from neoflow.codegen.mapping import Mapping, contraction, mappings
from neoflow.ir.bounds import reduction_points
from neoflow.ir.expr import Binary, Const, Expr, Read, Reduce, Select, conjuncts, index_variables, map_children
from neoflow.ir.index import var
from neoflow.ir.op import Op, Tensor
from neoflow.ir.simplify import read_offset
from neoflow.targets.cpu.depth_vector import DepthVectorPlan, depth_vector_code, depth_vector_cycles, depth_vector_plan
from neoflow.targets.cpu.packing import (
    AffineOperand,
    Strips,
    affine_operand,
    affine_packer,
    batch_base,
    direct_strips,
    gather_fraction,
    gather_step,
    operand_tables,
    round_up,
    vector_fraction,
)
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS
from neoflow.targets.cpu.tables import Table, built_once, index_table

MR, NR, KC, MC, NC = 6, 16, 256, 96, 2048
#: cycles of one depth step of the MR x NR micro-kernel on this machine (6 with AVX2, 3 with AVX-512)
STEP_CYCLES = AVX2.intrinsic("outer_product").cycles
NARROW_A_BYTES = 192 * 1024  # an ``a`` this small is packed whole (``_narrow``)
#: ... where it has at most ``MC`` rows, or ``NARROW_MAX_ROWS`` over a depth of at most ``NARROW_SHALLOW``:
#: MobileNetV2's 1x1 expansions (144 and 192 output channels over 24 and 32 input channels) ran 1.5x faster
#: narrow than as panels of ``MC`` rows (``neoflow tune``), while deeper ones (ResNet-18's, ShuffleNetV2's
#: 1x1 convolutions) ran slower
NARROW_MAX_ROWS, NARROW_SHALLOW = 4 * MC, 32
#: ... and over a batch of small outputs with long depths, where their column strips make this many tasks
NARROW_MIN_TASKS = 8
MIN_MACS = 1 << 15  # smaller contractions gain nothing from blocking
#: column strips a task of the narrow kernel packs together, at most: its packer reads neighbours in
#: each row of ``b`` (the four-op input gradient, 64 rows, in the step: 1, 2, 3, 4 strips a task 474,
#: 418, 455, 401 us; in another run 2, 4, 8 strips 441, 419, 458 us), while at least 8 tasks are left
#: and the strips (each the micro-kernel's ``b`` down every row strip) stay within ``TASK_PACK_BYTES``
TASK_STRIPS = 4
TASK_PACK_BYTES = 32 * 1024
_THREADS = """#ifdef _OPENMP
        const int64_t threads_ = omp_get_max_threads();
#else
        const int64_t threads_ = 1;
#endif"""
GENERIC_CYCLES_PER_POINT = 2.0
#: the blocked kernel's structures: ``panel`` (blocks of ``b`` packed ahead into a shared buffer, each thread
#: packing its own blocks of ``a``), ``narrow`` (all of ``a`` packed once, each task packing one strip of
#: ``b``: ``_narrow``), ``split`` (the depth shared out among the threads: ``_split_depth``), ``batched``
#: (each thread whole batch items, packing and multiplying each alone: ``_batched``)
STRUCTURES = ("panel", "narrow", "split", "batched")
#: a batch item's product this small (multiply-adds), over at least ``BATCHED_MIN_ITEMS`` items, runs as
#: ``batched``: a panel's parallel regions and barriers a depth block of every item cost more than its work
#: (attention's 64 x 64 x 16 products per head in the benchmark's ViT, a grouped convolution's 16 x 256 x 144 per group)
BATCHED_MAX_MACS, BATCHED_MIN_ITEMS = 1 << 21, 8
#: ... and its packed operands fit a thread's share of the cache together
BATCHED_PACK_BYTES = 512 * 1024
#: cycles per output element written back after a depth block, and extra ones for storing it alone
WRITE_CYCLES, SCATTER_CYCLES = 1.5, 2.5
VECTOR_PACK_CYCLES = 1.0  # per element of a strip copied with vector loads
GATHER_PACK_CYCLES = 1.5  # per element of a strided strip gathered (two 8-lane gathers per depth step)

MICROKERNEL = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
/* c (6 rows of 16, contiguous) = a b, or with from_c c += a b: one zmm register a row; two
   sets of six accumulators take turns over the depth, so twelve FMA chains are in flight
   (six would leave the FMA units waiting on their latency); summed at the end */
static inline void nf_micro_6x16_from(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                                      int from_c) {
#define NF_START(q) (from_c ? _mm512_loadu_ps(c + (q)) : _mm512_setzero_ps())
    __m512 c0 = NF_START(0), c1 = NF_START(16), c2 = NF_START(32), c3 = NF_START(48);
    __m512 c4 = NF_START(64), c5 = NF_START(80);
#undef NF_START
    __m512 d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps(), d2 = _mm512_setzero_ps();
    __m512 d3 = _mm512_setzero_ps(), d4 = _mm512_setzero_ps(), d5 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < kc; k += 2) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), b0, c0); d0 = _mm512_fmadd_ps(_mm512_set1_ps(a[6]), b1, d0);
        c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[1]), b0, c1); d1 = _mm512_fmadd_ps(_mm512_set1_ps(a[7]), b1, d1);
        c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[2]), b0, c2); d2 = _mm512_fmadd_ps(_mm512_set1_ps(a[8]), b1, d2);
        c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[3]), b0, c3); d3 = _mm512_fmadd_ps(_mm512_set1_ps(a[9]), b1, d3);
        c4 = _mm512_fmadd_ps(_mm512_set1_ps(a[4]), b0, c4); d4 = _mm512_fmadd_ps(_mm512_set1_ps(a[10]), b1, d4);
        c5 = _mm512_fmadd_ps(_mm512_set1_ps(a[5]), b0, c5); d5 = _mm512_fmadd_ps(_mm512_set1_ps(a[11]), b1, d5);
        a += 12;
        b += 32;
    }
    if (k < kc) {
        const __m512 b0 = _mm512_loadu_ps(b);
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), b0, c0); c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[1]), b0, c1);
        c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[2]), b0, c2); c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[3]), b0, c3);
        c4 = _mm512_fmadd_ps(_mm512_set1_ps(a[4]), b0, c4); c5 = _mm512_fmadd_ps(_mm512_set1_ps(a[5]), b0, c5);
    }
    _mm512_storeu_ps(c + 0, _mm512_add_ps(c0, d0)); _mm512_storeu_ps(c + 16, _mm512_add_ps(c1, d1));
    _mm512_storeu_ps(c + 32, _mm512_add_ps(c2, d2)); _mm512_storeu_ps(c + 48, _mm512_add_ps(c3, d3));
    _mm512_storeu_ps(c + 64, _mm512_add_ps(c4, d4)); _mm512_storeu_ps(c + 80, _mm512_add_ps(c5, d5));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* c (6 rows of 16, contiguous) = a b, or with from_c c += a b (the accumulators start from c);
   inlined with a constant from_c, the other start is compiled away */
static inline void nf_micro_6x16_from(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                                      int from_c) {
#define NF_START(q) (from_c ? _mm256_loadu_ps(c + (q)) : _mm256_setzero_ps())
    __m256 c00 = NF_START(0), c01 = NF_START(8), c10 = NF_START(16), c11 = NF_START(24);
    __m256 c20 = NF_START(32), c21 = NF_START(40), c30 = NF_START(48), c31 = NF_START(56);
    __m256 c40 = NF_START(64), c41 = NF_START(72), c50 = NF_START(80), c51 = NF_START(88);
#undef NF_START
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
        __m256 x;
        x = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51);
        a += 6;
        b += 16;
    }
    _mm256_storeu_ps(c + 0, c00); _mm256_storeu_ps(c + 8, c01); _mm256_storeu_ps(c + 16, c10);
    _mm256_storeu_ps(c + 24, c11); _mm256_storeu_ps(c + 32, c20); _mm256_storeu_ps(c + 40, c21);
    _mm256_storeu_ps(c + 48, c30); _mm256_storeu_ps(c + 56, c31); _mm256_storeu_ps(c + 64, c40);
    _mm256_storeu_ps(c + 72, c41); _mm256_storeu_ps(c + 80, c50); _mm256_storeu_ps(c + 88, c51);
}
#else
typedef float nf_v8 __attribute__((vector_size(32)));
static inline void nf_micro_6x16_from(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                                      int from_c) {
    nf_v8 acc[6][2] = {{{0}}};
    if (from_c)
        memcpy(acc, c, sizeof(acc));
    for (int64_t k = 0; k < kc; ++k) {
        nf_v8 b0, b1;
        memcpy(&b0, b, 32);
        memcpy(&b1, b + 8, 32);
        for (int m = 0; m < 6; ++m) {
            const nf_v8 x = {a[m], a[m], a[m], a[m], a[m], a[m], a[m], a[m]};
            acc[m][0] += x * b0;
            acc[m][1] += x * b1;
        }
        a += 6;
        b += 16;
    }
    memcpy(c, acc, sizeof(acc));
}
#endif
static inline void nf_micro_6x16(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c) {
    nf_micro_6x16_from(kc, a, b, c, 0);
}
/* c (6 rows of 16, contiguous) += a b */
static inline void nf_micro_6x16_acc(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c) {
    nf_micro_6x16_from(kc, a, b, c, 1);
}
#if defined(__AVX512F__)
/* every other element (the depth-vectorised kernel, the packers): p[0], p[2], ..., p[30]
   (the last element of the second load is masked off: it may lie past the tensor) */
static inline __m512 nf_load_pairs(const float *p) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_permutex2var_ps(_mm512_loadu_ps(p), even, _mm512_maskz_loadu_ps(0x7FFF, p + 16));
}
/* the first count (1 to 16) of the 16 elements step apart from p, the other lanes zero and not read */
static inline __m512 nf_load_run(const float *p, int64_t step, int count) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (step == 1)
        return _mm512_maskz_loadu_ps(mask, p);
    const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int32_t)step));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, lane, p, 4);
}
#endif
#if defined(__AVX2__)
#include <immintrin.h>
/* the 8 x 8 block in r[0..7] transposed in place (the packers' depth runs) */
static inline void nf_transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif
/* the 6 x 16 product written (or, with accumulate, added) straight into rows of c that are
   ldc floats apart, each row's 16 columns contiguous; the rows are fetched while it computes */
static inline void nf_micro_6x16_to(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                                    int64_t ldc, int accumulate) {
    float tile[96] __attribute__((aligned(64)));
    for (int r = 0; r < 6; ++r) {
        __builtin_prefetch(c + r * ldc, 1);
        __builtin_prefetch(c + r * ldc + 15, 1);
    }
    nf_micro_6x16(kc, a, b, tile);
    for (int r = 0; r < 6; ++r) {
        float *restrict row = c + r * ldc;
        const float *restrict from = tile + r * 16;
        if (accumulate)
            for (int j = 0; j < 16; ++j) row[j] += from[j];
        else
            for (int j = 0; j < 16; ++j) row[j] = from[j];
    }
}
"""


def _rows_variants(microkernel: str) -> str:
    """The AVX-512 micro-kernel reading ``b``'s depth rows where they lie, ``rows[k]`` floats
    past ``b`` (``packing.direct_strips``), made from the packed one's own text:
    ``nf_micro_6x16_rows_from`` and ``nf_micro_6x16_rows_to``."""
    signature = (
        "const float *restrict b, float *restrict c,",
        "const float *restrict b,\n    const int64_t *restrict rows, float *restrict c,",
    )
    start = microkernel.index("static inline void nf_micro_6x16_from(")
    body = _edited(
        microkernel[start : microkernel.index("#elif", start)],
        # one copy a library, called: inlined at each call site it cost every build of a convolution
        # a tenth more compile time, for calls of a few thousand cycles each
        ("static inline void nf_micro_6x16_from(", "__attribute__((noinline)) static void nf_micro_6x16_rows_from("),
        signature,
        (
            "_mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16)",
            "_mm512_loadu_ps(b + rows[k]), b1 = _mm512_loadu_ps(b + rows[k + 1])",
        ),
        ("        b += 32;\n", ""),
        ("const __m512 b0 = _mm512_loadu_ps(b);", "const __m512 b0 = _mm512_loadu_ps(b + rows[k]);"),
    )
    to = _edited(
        microkernel[microkernel.index("static inline void nf_micro_6x16_to(") :],
        ("nf_micro_6x16_to(", "nf_micro_6x16_rows_to("),
        signature,
        ("nf_micro_6x16(kc, a, b, tile);", "nf_micro_6x16_rows_from(kc, a, b, rows, tile, 0);"),
    )
    absent = (
        "/* without AVX-512 no strip is read in place (``direct_`` stays null): these are never called */\n"
        "#define nf_micro_6x16_rows_from(kc, a, b, rows, c, from_c) ((void)0)\n"
        "#define nf_micro_6x16_rows_to(kc, a, b, rows, c, ldc, accumulate) ((void)0)\n"
    )
    return f"#if defined(__AVX512F__)\n{body}{to}#else\n{absent}#endif\n"


#: the store arguments of ``nf_micro_6x16_to`` (and ``_rows_to``) in the blocked kernels' row loops
_TO_ARGUMENTS = "to_batch + row_off[ic + ir] + col_off[jc + jr], row_step, pc != 0"
_INDENT = " " * 40


def _edited(text: str, *edits: tuple[str, str]) -> str:
    """``text`` with each ``(old, new)`` of ``edits`` replaced (each must be there)."""
    for old, new in edits:
        if old not in text:
            raise AssertionError(f"the micro-kernel's text no longer has '{old}'")
        text = text.replace(old, new)
    return text


MICROKERNEL += _rows_variants(MICROKERNEL)


def fold_domain(op: Op) -> Op:
    """``op`` with its contraction's domain condition moved onto the operand
    reads it restricts: ``ReduceAdd({r | cond}, A * B)`` becomes
    ``ReduceAdd({r}, Select(cond_A, A, 0) * Select(cond_B, B, 0))`` when every
    conjunct of ``cond`` only involves variables of one operand's indices (the
    excluded terms become zero products; a guarded read is never performed
    outside its condition).  Other ops are returned unchanged."""
    parts = split_epilogue(op.body, op)
    if parts is None:
        return op
    body, epilogue = parts
    if body.where is None or not isinstance(body.body, Binary) or body.body.op != "*":
        return op
    factors = [body.body.a, body.body.b]
    scopes = [index_variables(f) for f in factors]
    guards: list[list[Expr]] = [[], []]
    for part in conjuncts(body.where):
        needed = index_variables(part)
        side = next((k for k in (0, 1) if needed <= scopes[k]), None)
        if side is None:
            return op
        guards[side].append(part)
    for k in (0, 1):
        for part in reversed(guards[k]):
            factors[k] = Select(part, factors[k], Const(0))
    reduce = Reduce(body.kind, body.axes, body.extents, Binary("*", factors[0], factors[1]), None)
    new_body = with_reduce(epilogue, reduce)
    return Op(op.output, op.indices, new_body, op.inputs, op.ranges, op.range_sources, op.info, op.scatter)


@dataclass(frozen=True)
class Blocking:
    """The blocked kernel's block sizes (``kc`` depth, ``mc`` rows of ``a``, ``nc`` columns of ``b``)
    and its structure (one of ``STRUCTURES``, or ``auto``: the one the estimate picks for each
    piece).  The defaults are what runs without tuning (``targets.cpu.tuning`` measures others); a
    structure a piece cannot take (``narrow`` where ``a`` changes with the batch) leaves it ``auto``."""

    kc: int = KC
    mc: int = MC
    nc: int = NC
    structure: str = "auto"

    def __post_init__(self) -> None:
        if min(self.kc, self.mc, self.nc) < 1 or self.mc % MR or self.nc % NR:
            raise ValueError(f"block sizes kc {self.kc}, mc {self.mc} (of {MR}), nc {self.nc} (of {NR})")
        if self.structure not in ("auto", *STRUCTURES):
            raise ValueError(f"no blocked-kernel structure '{self.structure}' (one of auto, {', '.join(STRUCTURES)})")


#: the blocking that runs without tuning
DEFAULT_BLOCKING = Blocking()


@dataclass(frozen=True)
class GemmPlan:
    """How the blocked kernel computes an op: its dense pieces (``lattice.split_lattice``),
    each with the outer-product mapping it runs on (None for a piece that is zero)."""

    pieces: tuple[tuple[Piece, Mapping | None], ...]

    def describe(self) -> str:
        """One line per piece: its slice of the output and its mapping."""
        lines = []
        for piece, mapping in self.pieces:
            where = f"offset {piece.base}, strides {piece.strides}"
            lines.append(f"{where}: {'zero' if mapping is None else mapping.describe()}")
        return "\n".join(lines)


def _piece_mapping(op: Op, strides: dict[str, int] | None = None) -> Mapping | None:
    """The cheapest outer-product mapping of one dense piece (after folding its domain
    onto guards) writing the output at ``strides`` (None: its own row-major layout)."""
    op = fold_domain(op)
    parts = split_epilogue(op.body, op)
    if parts is None:
        return None
    probe = Op(op.output, op.indices, parts[0], op.inputs, op.ranges)
    if contraction(probe) is None:
        return None
    outputs = set(op.indices)
    candidates = [m for m in mappings(probe, "cpu", "outer_product") if set(m.outer) <= outputs]
    if not candidates:
        return None
    return min(candidates, key=lambda m: (kernel_cycles(m, op, strides), m.describe()))


@lru_cache(maxsize=1024)
def gemm_plan(op: Op) -> GemmPlan | None:
    """The blocked-kernel plan for ``op``, or None when the op is not a float32
    contraction (plus an optional epilogue) worth blocking: its lattice domain is
    split into dense pieces, each mapped onto the outer-product intrinsic; the
    plan is taken only when its estimated cycles beat the plain loop nest's.
    Cached: the lowering, the two-stage split and the cost model all ask."""
    if op.dtype != "float32" or any(t.dtype != "float32" for t in op.inputs) or op.scatter is not None:
        return None
    pieces = split_lattice(op)
    if pieces is None:
        return None
    planned: list[tuple[Piece, Mapping | None]] = []
    macs = 0
    for piece in pieces:
        if piece.empty:
            planned.append((piece, None))
            continue
        mapping = _piece_mapping(piece.op, piece.strides)
        if mapping is None:
            return None
        planned.append((piece, mapping))
        macs += math.prod(piece.op.extent.values())
    if macs < MIN_MACS:
        return None
    plan = GemmPlan(tuple(planned))
    # the plain loop nest visits only the domain's points (isl makes strided domains exact loops);
    # at a couple of cycles per multiply-add it wins where blocking would pad or pack too much
    if plan_cycles(plan) >= GENERIC_CYCLES_PER_POINT * domain_points(op):
        return None
    return plan


@lru_cache(maxsize=1024)
def blocked_form(op: Op) -> tuple[Op, GemmPlan] | None:
    """The op the blocked kernel runs for ``op`` and its plan: ``op`` itself, or where that has no
    plan, ``op`` with its grouped output indices split (``split_groups``: a grouped convolution, a
    batch of contractions; its output's layout is ``op``'s), or None.  Cached as ``gemm_plan`` is:
    the planner's cost model asks it of every candidate kernel, the lowering again."""
    plan = gemm_plan(op)
    if plan is not None:
        return op, plan
    grouped = split_groups(op)
    plan = gemm_plan(grouped) if grouped is not None else None
    if plan is not None:
        return grouped, plan
    aliased = alias_shared_operand(op)
    plan = gemm_plan(aliased) if aliased is not None else None
    return None if plan is None else (aliased, plan)


#: the suffix of the name under which ``alias_shared_operand`` has a contraction's second operand read a
#: tensor its first operand reads too
ALIAS = "__operand_b"


def alias_shared_operand(op: Op) -> Op | None:
    """``op`` with the reads of its product's second factor renamed (``ALIAS``) where both factors read
    one tensor (attention's ``Q K^T`` from one ``qkv`` tensor: ``T[0, b, h, i, k] * T[1, b, h, j, k]``),
    the alias an input of its own, so that the mapper sees two operands; None where they read none in
    common.  The kernel is called with the tensor for both (``lower.blocked_function``)."""
    parts = product_sum(op) if op.scatter is None else None
    if parts is None:
        return None
    reduce, epilogue, product = parts
    shared = {n.tensor for n in product.a.walk() if isinstance(n, Read)} & {
        n.tensor for n in product.b.walk() if isinstance(n, Read)
    }
    if not shared:
        return None

    def rename(node: Expr) -> Expr:
        if isinstance(node, Read) and node.tensor in shared:
            return Read(node.tensor + ALIAS, node.indices, node.tensor_dtype)
        return map_children(node, rename)

    moved = Reduce(reduce.kind, reduce.axes, reduce.extents, Binary("*", product.a, rename(product.b)), reduce.where)
    aliases = tuple(Tensor(t.name + ALIAS, t.shape, t.dtype) for t in op.inputs if t.name in shared)
    return Op(op.output, op.indices, with_reduce(epilogue, moved), (*op.inputs, *aliases), op.ranges)


def unsplit_cycles(op: Op) -> float:
    """Estimated cycles of ``op`` run as it is: on the blocked kernel where ``gemm_plan``
    takes it, else as the loop nest (``GENERIC_CYCLES_PER_POINT`` a domain point)."""
    plan = gemm_plan(op)
    return GENERIC_CYCLES_PER_POINT * domain_points(op) if plan is None else plan_cycles(plan)


def plan_cycles(plan: GemmPlan) -> float:
    """Estimated cycles of ``plan``: its pieces' kernels, half a cycle per element zeroed."""
    return sum(
        piece.op.output.size * 0.5 if mapping is None else kernel_cycles(mapping, piece.op, piece.strides)
        for piece, mapping in plan.pieces
    )


def domain_points(op: Op) -> float:
    """About how many (output point, reduction point) pairs ``op``'s top reduction
    visits (``bounds.reduction_points`` per output point)."""
    reduce = split_epilogue(op.body, op)[0]
    return math.prod(op.extent[v] for v in op.indices) * reduction_points(reduce, op.extent)


def kernel_cycles(mapping: Mapping, op: Op, strides: dict[str, int] | None = None) -> float:
    """Estimated cycles of the kernel computing ``op`` (a dense piece, its domain folded
    onto guards, writing the output at ``strides``; None: row-major) for ``mapping``: the
    depth-vectorised kernel's (``depth_vector``) where it runs, otherwise micro-kernel
    calls (``STEP_CYCLES`` a depth step), packing (``_pack_cycles`` per element; all of
    ``a`` once on the narrow structure, ``_narrow``) and the write-back after each
    depth block (more when the depth is one block and the tile's columns are not a
    contiguous run of the output: stores element by element), summed over the batch
    (outer) points."""
    extent = op.extent
    groups = dict(mapping.axes)
    m, n, k = (math.prod(extent[v] for v in groups[a]) for a in ("i", "j", "k"))
    batches = math.prod(extent[v] for v in mapping.outer)
    factor_a, factor_b = _operand_factors(op, mapping)
    batch = [(v, extent[v]) for v in mapping.outer]
    if AVX512:
        shapes = {t.name: t.shape for t in op.inputs}
        vector = _depth_vector(factor_a, factor_b, shapes, extent, (m, n, k), [(v, extent[v]) for v in groups["k"]])
        if vector is not None:
            return batches * (depth_vector_cycles(vector, (m, n, k), STEP_CYCLES / MR) + m * n * WRITE_CYCLES)
    narrow = _auto_structure((m, n, k), batch, factor_a) == "narrow"
    compute = round_up(m, MR) * round_up(n, NR) * k / (MR * NR) * STEP_CYCLES
    pack_b = k * round_up(n, NR) * _pack_cycles(op, factor_b, groups["j"], groups["k"], NR)
    pack_a = round_up(m, MR) * k * _pack_cycles(op, factor_a, groups["i"], groups["k"], MR)
    blocks = 1 if narrow else -(-k // KC)
    write_back = m * n * blocks * WRITE_CYCLES
    columns = groups["j"]
    in_rows = tuple(op.indices[len(op.indices) - len(columns) :]) == tuple(columns)
    if blocks == 1 and not (in_rows and (strides is None or strides[columns[-1]] == 1)):
        # one depth block: each tile is stored once after a short depth loop, and storing it
        # element by element through the tables (columns not the output's rows) costs about
        # as much as computing it; behind a long depth loop the difference does not show
        write_back += m * n * SCATTER_CYCLES
    if narrow:
        return batches * (compute + pack_b + write_back) + pack_a
    return batches * (compute + -(-n // NC) * pack_a + pack_b + write_back)


def _operand_factors(op: Op, mapping: Mapping) -> tuple[Expr, Expr]:
    """The two factors of ``op``'s (folded) contraction: operand ``a``'s, then ``b``'s."""
    product = split_epilogue(op.body, op)[0].body
    assert isinstance(product, Binary)
    if _first_read(product.a) != dict(mapping.operands)["a"]:
        return product.b, product.a
    return product.a, product.b


def _pack_cycles(op: Op, factor: Expr, side: tuple[str, ...], depth: tuple[str, ...], width: int) -> float:
    """Estimated cycles per element packed of one operand: ``VECTOR_PACK_CYCLES`` for the
    share the packer copies with vector loads (``packing.vector_fraction``),
    ``GATHER_PACK_CYCLES`` for the share it gathers (``packing.gather_fraction``; with
    AVX-512 a step of two, compacted by permutes, costs a vector copy), otherwise
    a couple of cycles plus one per index variable read from the tables, one per guard
    checked and two per clamp applied.  Cached by what it depends on — the operand, the
    tensors it reads and its variables' extents — not by the op: the fusion search prices
    the same operand in many candidate kernels that differ in their epilogue alone."""
    names = {n.tensor for n in factor.walk() if isinstance(n, Read)}
    tensors = tuple(t for t in op.inputs if t.name in names)
    used = set(side) | set(depth) | index_variables(factor)
    ranges = tuple((v, e) for v, e in op.ranges if v in used)
    return _operand_pack_cycles(factor, tensors, ranges, side, depth, width)


@lru_cache(maxsize=8192)
def _operand_pack_cycles(
    factor: Expr,
    tensors: tuple[Tensor, ...],
    ranges: tuple[tuple[str, int], ...],
    side: tuple[str, ...],
    depth: tuple[str, ...],
    width: int,
) -> float:
    """``_pack_cycles`` of ``factor`` reading ``tensors``, its variables running over ``ranges``."""
    shapes = {t.name: t.shape for t in tensors}
    extent = dict(ranges)
    sides = [(v, extent[v]) for v in side]
    depths = [(v, extent[v]) for v in depth]
    side_inner = _inner_is_first(factor, {t.name: t for t in tensors}, sides, depths, ranges)
    operand = _affine(factor, tuple(sorted(shapes.items())), ranges)
    size = math.prod(shapes[operand.tensor]) if operand is not None else 0
    strips = Strips(side, depth, extent, size)
    vector = vector_fraction(operand, width, side_inner, strips)
    gathered = gather_fraction(operand, width, side_inner, strips)
    # element by element: a couple of cycles, one per table read, one per guard checked, and
    # two per clamp applied (a compare and a select, NaN kept)
    guards, clamps = (len(operand.ranges), len(operand.clamps)) if operand is not None else (0, 0)
    scalar = 2.0 + len(side) + len(depth) + guards + 2 * clamps
    # a step of two is two loads and a permute a strip row on AVX-512, about a vector copy's cost
    gather = VECTOR_PACK_CYCLES if AVX512 and gather_step(operand, strips) == 2 else GATHER_PACK_CYCLES
    return vector * VECTOR_PACK_CYCLES + gathered * gather + (1 - vector - gathered) * scalar


def _lookup(name: str, flat: str, variables: list[tuple[str, int]]) -> str:
    """C declaring ``v_<name>`` for each variable of a group from its table."""
    loads = ", ".join(f"v_{v} = {name}_t[{d}]" for d, (v, _) in enumerate(variables))
    return f"const int32_t *{name}_t = {name}_tab + ({flat}) * {len(variables)}; const int64_t {loads};"


def _epilogue_loop(
    value: str, rows: list[tuple[str, int]], cols: list[tuple[str, int]], inner_step: int, from_tile: bool = False
) -> str:
    """C applying the epilogue ``value`` (C over ``acc_``, the finished sum, and the
    point's ``v_<variable>``s) to a tile in the last depth block: a tile just stored
    (``acc_`` read back from the output), or with ``from_tile`` the micro-kernel's
    ``tile`` (``acc_`` its value plus, after the first depth block, the output's), so
    that each element is written once, finished.  The tile's columns in a run of the
    innermost column variable (the others fixed) are finished in vector lanes, their
    variables read from the tables once a strip and once a row and the innermost
    counted up with the lane: where that variable steps the output by one
    (``inner_step``), any run; otherwise a full strip whose columns are contiguous in
    the output (and a run, where the epilogue reads a column variable).  An epilogue
    reading no column variable finishes any full strip whose columns are contiguous in
    the output (``dense``) in lanes too: a 1x1 convolution's bias and ReLU6 over 8x8
    images, whose 16 columns span two image rows, went through the tables element by
    element (4.0 against 0.8 ms for one of MobileNetV2's).  Any other tile is finished
    element by element through the tables."""
    inner, inner_extent = cols[-1]
    in_run = f"col_tab[(jc + jr) * {len(cols)} + {len(cols) - 1}] + width <= {inner_extent}"
    uses_columns = any(re.search(rf"\bv_{v}\b", value) for v, _ in cols)
    if inner_step == 1:
        lanes, condition = "width", in_run if uses_columns else f"dense || {in_run}"
    else:
        lanes, condition = str(NR), f"dense && width == {NR}" + (f" && {in_run}" if uses_columns else "")
    strip_variables, lane_variable = "", ""
    if uses_columns:
        strip_variables = f"{_lookup('col', 'jc + jr', cols)} const int64_t first_ = v_{inner};"
        lane_variable = f"const int64_t v_{inner} = first_ + jj;"

    def sum_at(element: str) -> str:
        return f"(pc == 0 ? 0.0f : {element}) + tile[ii * {NR} + jj]" if from_tile else element

    return f"""
                                    if (last_) {{
                                        if ({condition}) {{
                                            {strip_variables}
                                            for (int64_t ii = 0; ii < {MR} && ir + ii < mc; ++ii) {{
                                                float *to = to_batch + row_off[ic + ir + ii] + col_off[jc + jr];
                                                {_lookup("row", "ic + ir + ii", rows)}
                                                #pragma omp simd
                                                for (int64_t jj = 0; jj < {lanes}; ++jj) {{
                                                    {lane_variable}
                                                    const float acc_ = {sum_at("to[jj]")};
                                                    to[jj] = (float)({value});
                                                }}
                                            }}
                                        }} else
                                            for (int64_t ii = 0; ii < {MR} && ir + ii < mc; ++ii) {{
                                                float *to = to_batch + row_off[ic + ir + ii];
                                                {_lookup("row", "ic + ir + ii", rows)}
                                                for (int64_t jj = 0; jj < width; ++jj) {{
                                                    {_lookup("col", "jc + jr + jj", cols)}
                                                    const float acc_ = {sum_at("to[col_off[jc + jr + jj]]")};
                                                    to[col_off[jc + jr + jj]] = (float)({value});
                                                }}
                                            }}
                                    }}"""


def gemm_function(op: Op, plan: GemmPlan, name: str, blocking: Blocking = DEFAULT_BLOCKING) -> str:
    """The C function ``name`` computing ``op`` with the blocked outer-product kernel, piece by piece,
    blocked by ``blocking``."""
    params = "".join(f", const float *restrict in{i}" for i in range(len(op.inputs)))
    helpers, blocks = [], []
    for number, (piece, mapping) in enumerate(plan.pieces):
        if mapping is None:
            code = store_slice(piece, "0.0f", op.output.size)
        else:
            packers, code = _piece_code(piece, mapping, f"{name}_p{number}", params, blocking)
            helpers.append(packers)
        blocks.append(f"    {{ /* piece at offset {piece.base} */\n{code}\n    }}")
    body = "\n".join(blocks)
    return "\n".join(helpers) + f"\nvoid {name}(float *restrict out{params}) {{\n{body}\n}}\n"


def store_slice(piece: Piece, value: str, whole: int) -> str:
    """C storing ``value`` (which may use the piece's flat point index ``f``) at every
    point of ``piece``'s slice of ``out``, in parallel where ``whole`` (the points of
    the output the piece is a slice of) is large enough, as a store of all of it would be."""
    variables = [(v, piece.op.extent[v]) for v in piece.op.indices]
    target = " + ".join([str(piece.base), *(f"v_{v} * {piece.strides[v]}" for v, _ in variables)])
    if not variables:
        return f"        {{ const int64_t f = 0; out[{target}] = {value}; }}"
    # nested loops (the flat index computed, not divided out per point), all but the
    # innermost collapsed into one parallel loop
    flat = "0"
    for v, extent in variables:
        flat = f"v_{v}" if flat == "0" else f"({flat}) * {extent} + v_{v}"
    collapse = f" collapse({len(variables) - 1})" if len(variables) > 1 else ""
    loops = "\n".join(
        f"        {'    ' * depth}for (int64_t v_{v} = 0; v_{v} < {extent}; ++v_{v})"
        for depth, (v, extent) in enumerate(variables)
    )
    inner = "        " + "    " * len(variables)
    index_line = f"{inner}const int64_t f = {flat};\n" if re.search(r"\bf\b", value) else ""
    # decided here: an OpenMP region under a false if() still costs a team of one
    pragma = f"        #pragma omp parallel for{collapse}\n" if whole >= PARALLEL_MIN_POINTS else ""
    return f"""{pragma}{loops} {{
{index_line}{inner}out[{target}] = {value};
{inner[4:]}}}"""


def _piece_code(piece: Piece, mapping: Mapping, prefix: str, params: str, blocking: Blocking) -> tuple[str, str]:
    """C computing one dense piece with the blocked kernel blocked by ``blocking``: the packing
    functions (named ``<prefix>_pack_a``/``_b``) and the block of code calling them."""
    op = fold_domain(piece.op)
    epilogue = split_epilogue(op.body, op)[1]
    factor_a, factor_b = _operand_factors(op, mapping)
    groups = dict(mapping.axes)
    extent = op.extent
    tensors = {t.name: t for t in op.inputs}
    names = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
    index = IndexPrinter(lambda v: f"v_{v}", lambda t, idx: printer.read(t, idx))
    printer = ValuePrinter(tensors, names, index, lambda node: "0", extent)
    finish = ValuePrinter(tensors, names, index, lambda node: "acc_", extent)  # the epilogue, given the sum
    value_a, value_b = printer(factor_a, "float32"), printer(factor_b, "float32")
    rows = [(v, extent[v]) for v in groups["i"]]
    cols = [(v, extent[v]) for v in groups["j"]]
    depth = [(v, extent[v]) for v in groups["k"]]
    batch = [(v, extent[v]) for v in mapping.outer]
    m, n, k = (math.prod(e for _, e in g) for g in (rows, cols, depth))
    batches = math.prod(e for _, e in batch)

    def offset(group: list[tuple[str, int]]) -> str:
        return " + ".join(f"v_{v} * {piece.strides[v]}" for v, _ in group) or "0"

    epilogue_loop = tile_epilogue = ""
    if epilogue is not None:
        finished = finish(epilogue, "float32"), rows, cols, piece.strides[cols[-1][0]]
        epilogue_loop = _epilogue_loop(*finished)
        tile_epilogue = _epilogue_loop(*finished, from_tile=True) + "\n                                    else"
    # the packers take the inputs and the batch variables' values
    params += "".join(f", int64_t v_{v}" for v, _ in batch)
    arguments = "".join(f", in{i}" for i in range(len(op.inputs))) + "".join(f", v_{v}" for v, _ in batch)
    a_inner = _inner_is_first(factor_a, tensors, rows, depth, op.ranges)
    b_inner = _inner_is_first(factor_b, tensors, cols, depth, op.ranges)
    shapes = {t.name: t.shape for t in op.inputs}
    pack_a_code = _operand_packer(
        prefix, "a", MR, factor_a, value_a, rows, depth, batch, a_inner, shapes, names, params, extent
    )
    pack_b_code = _operand_packer(
        prefix, "b", NR, factor_b, value_b, cols, depth, batch, b_inner, shapes, names, params, extent
    )
    sides = (pack_a_code, pack_b_code)
    packers = "\n".join(side.code for side in sides)
    packer_tables = [table for side in sides for table in side.tables]
    b_outer = "kc" if b_inner else "nc"

    zero_b = f"bpack[(j / {NR}) * {NR} * kc + p * {NR} + j % {NR}]"  # column j, depth p of the packed b

    def pack_b(lo: str, hi: str) -> str:
        return f"""{prefix}_pack_b(bpack, jc, nc, pc, kc, {lo}, {hi}, {pack_b_code.arguments}{arguments});
                    for (int64_t j = nc; j < strips * {NR}; ++j)
                        for (int64_t p = 0; p < kc; ++p) {zero_b} = 0.0f;"""

    zero_a = f"apack[(i / {MR}) * {MR} * kc + p * {MR} + i % {MR}]"
    a_outer = "kc" if a_inner else "mc"
    pack_a = f"""{prefix}_pack_a(apack, ic, mc, pc, kc, 0, {a_outer}, {pack_a_code.arguments}{arguments});
                            for (int64_t i = mc; i < (mc + {MR - 1}) / {MR} * {MR}; ++i)
                                for (int64_t p = 0; p < kc; ++p) {zero_a} = 0.0f;"""
    output = f"float *restrict outp = out + {piece.base};"
    output_tables = [index_table("row", rows, offset(rows)), index_table("col", cols, offset(cols))]
    all_tables = [*output_tables, index_table("dep", depth, None), *packer_tables]
    split_tables = f"""{output}
        {built_once(all_tables)}
{_THREADS}"""
    structure = _structure(blocking.structure, (m, n, k), batch, factor_a)
    if structure == "split":
        epilogue_term = ""
        if epilogue is not None:
            epilogue_term = f""" {_lookup("row", "i", rows)} {_lookup("col", "jc + j", cols)}
                    {{ const float acc_ = sum; sum = (float)({finish(epilogue, "float32")}); }}"""
        open_batch = f"""for (int64_t batch_ = 0; batch_ < {batches}; ++batch_) {{
            {unflatten_index("batch_", batch)}
            float *restrict to_batch = outp + {offset(batch)};"""
        sums = _partial_sums(m, epilogue_term)
        split = f"""
        {split_tables}{_depth_split_code((m, n, k), blocking, open_batch, pack_a, pack_b("0", b_outer), sums)}"""
        auto = blocking.structure == "auto"
        vector = _depth_vector(factor_a, factor_b, shapes, extent, (m, n, k), depth) if auto else None
        if vector is None:
            return packers, split
        # the depth-vectorised kernel reads the depth tables only where each run starts
        a_base, b_base = (batch_base(operand.offset, batch) for operand in (vector.a, vector.b))
        inputs = (names[vector.a.tensor], names[vector.b.tensor])
        operands = (("a", vector.a, rows), ("b", vector.b, cols))
        vector_tables = [
            table
            for side, operand, group in operands
            for table in (
                operand_tables(f"{side}_side", operand, group, False),
                operand_tables(f"{side}_dep", operand, depth[:-1], True),
            )
        ]
        code = depth_vector_code(vector, (m, n, k), inputs, (a_base, b_base), open_batch, sums)
        return (
            packers,
            f"""
#if defined(__AVX512F__)
        {output}
        {built_once([*output_tables, *vector_tables])}
{_THREADS}{code}
#else{split}
#endif""",
        )

    def row_strips(b_strip: str, direct: bool = False, a_strip: str = "apack + ir * kc") -> str:
        """C running the micro-kernel down rows ``[ic, ic + mc)`` (their packed strips at
        ``a_strip``) against the packed column strip at ``b_strip`` (``direct``: or, where
        ``direct_`` is set, the strip where it lies in the operand's tensor, its depth rows at
        the ``b_dep[0]`` offsets), storing (or adding) each tile, then the epilogue."""
        to = f"nf_micro_6x16_to(kc, {a_strip}, {b_strip}, "
        tile = f"nf_micro_6x16(kc, {a_strip}, {b_strip}, tile)"
        if direct:
            rows = f"kc, {a_strip}, direct_, b_dep[0] + pc"
            to = f"if (direct_) nf_micro_6x16_rows_to({rows}, {_TO_ARGUMENTS});\n{_INDENT}else {to}"
            tile = f"if (direct_) nf_micro_6x16_rows_from({rows}, tile, 0);\n{_INDENT}else {tile}"
        return f"""                                for (int64_t ir = 0; ir < mc; ir += {MR}) {{
                                    const int64_t row_step = row_steps[(ic + ir) / {MR}];
                                    if (dense && row_step) {{
                                        {to}{_TO_ARGUMENTS});{epilogue_loop}
                                    }} else {{
                                        {tile};{tile_epilogue}
                                        for (int64_t ii = 0; ii < {MR} && ir + ii < mc; ++ii) {{
                                            const float *from = tile + ii * {NR};
                                            float *to = to_batch + row_off[ic + ir + ii];
                                            if (pc == 0)
                                                for (int64_t jj = 0; jj < width; ++jj)
                                                    to[col_off[jc + jr + jj]] = from[jj];
                                            else
                                                for (int64_t jj = 0; jj < width; ++jj)
                                                    to[col_off[jc + jr + jj]] += from[jj];
                                        }}
                                    }}
                                }}"""

    strips_of_rows = -(-m // MR)
    row_steps = Table(
        "static int64_t *row_steps;",
        f"""/* the distance between the rows of each full strip of {MR} output rows, 0 where uneven */
row_steps = (int64_t *)malloc(sizeof(int64_t) * {strips_of_rows});
for (int64_t s = 0; s < {strips_of_rows}; ++s) {{
    int64_t step = s * {MR} + {MR} <= {m} ? row_off[s * {MR} + 1] - row_off[s * {MR}] : 0;
    for (int64_t r = 2; step && r < {MR}; ++r)
        if (row_off[s * {MR} + r] - row_off[s * {MR} + r - 1] != step) step = 0;
    row_steps[s] = step;
}}""",
    )

    def tables(*extra: Table) -> str:
        """C with the output's pointer, every table (``extra`` last) built once, the thread count."""
        return f"""{output}
        {built_once([*all_tables, row_steps, *extra])}
{_THREADS}"""

    if structure == "batched":
        strips = -(-n // NR)
        return (
            packers,
            f"""
        {tables()}
        /* each thread whole batch items: an item's product is small, packed and multiplied by one thread */
        #pragma omp parallel
        {{
            NF_SCRATCH(float, apack, {round_up(k * round_up(m, MR), 16)});
            NF_SCRATCH(float, bpack, {k * strips * NR});
            float tile[{MR * NR}] __attribute__((aligned(64)));
            const int64_t ic = 0, jc = 0, mc = {m}, nc = {n}, pc = 0, kc = {k}, strips = {strips};
            const int last_ = 1;
            (void)last_;
            #pragma omp for schedule(static)
            for (int64_t batch_ = 0; batch_ < {batches}; ++batch_) {{
                {unflatten_index("batch_", batch)}
                float *restrict to_batch = outp + {offset(batch)};
                {pack_a}
                {pack_b("0", b_outer)}
                for (int64_t jr = 0; jr < nc; jr += {NR}) {{
                    const int64_t width = nc - jr < {NR} ? nc - jr : {NR};
                    int dense = width == {NR};
                    for (int64_t jj = 1; dense && jj < {NR}; ++jj) dense = col_off[jr + jj] == col_off[jr] + jj;
{row_strips("bpack + jr * kc")}
                }}
            }}
        }}""",
        )
    if structure == "narrow":
        a_whole = f"{prefix}_pack_a(apack, 0, {m}, 0, {k}, 0, {k if a_inner else m}, {pack_a_code.arguments}"
        a_whole += "".join(f", in{i}" for i in range(len(op.inputs))) + ", 0" * len(batch) + ");"
        strips = -(-n // NR)
        together = max(1, min(TASK_STRIPS, strips // 8, TASK_PACK_BYTES // (k * NR * 4)))
        tasks = -(-strips // together)
        b_strip = f"{prefix}_pack_b(bpack, j0, span, 0, {k}, 0, {k if b_inner else 'span'}, {pack_b_code.arguments}"
        b_strip += f"{arguments});"
        # a strip the micro-kernel can read where it lies is not packed (AVX-512; one strip a task)
        operand_b = affine_operand(factor_b, shapes, extent)
        extremes, direct_check = [], ""
        if operand_b is not None and not operand_b.clamps and together == 1 and b_inner:
            size = math.prod(shapes[operand_b.tensor])
            table, direct_check = direct_strips(operand_b, names[operand_b.tensor], size, batch, k)
            extremes = [table]
            direct_check = f"""
#if defined(__AVX512F__)
                {direct_check}
#else
                const float *const direct_ = 0;
#endif"""
        pack = f"""{b_strip}
                for (int64_t j = span; j < (span + {NR - 1}) / {NR} * {NR}; ++j)
                    for (int64_t p = 0; p < kc; ++p) {zero_b} = 0.0f;"""
        if direct_check:
            pack = f"""{direct_check}
                if (!direct_) {{
                {pack}
                }}"""
        multiply = row_strips(f"bpack + (jr - j0) * {k}", direct=bool(direct_check))
        blocks = -(-k // KC)
        if blocks > 1:
            # a deep strip in depth blocks, each multiplied by every row strip while in the L1 cache (the
            # whole depth of a 3x3 convolution over 64 channels, 576 x 16 floats, and an a strip beside it
            # overflowed the 48 KiB of an Intel core's L1)
            width = -(-k // blocks)
            a_strip, b_strip = f"apack + ir * {k} + pc * {MR}", f"bpack + (jr - j0) * {k} + pc * {NR}"
            multiply = f"""                    for (int64_t block_ = 0; block_ < {k}; block_ += {width}) {{
                    const int64_t pc = block_, kc = block_ + {width} < {k} ? {width} : {k} - block_;
                    const int last_ = pc + kc >= {k};
{row_strips(b_strip, direct=bool(direct_check), a_strip=a_strip)}
                    }}"""
        pack_and_multiply = f"""{pack}
                for (int64_t jr = j0; jr < j0 + span; jr += {NR}) {{
                    const int64_t width = j0 + span - jr < {NR} ? j0 + span - jr : {NR};
                    int dense = width == {NR};
                    for (int64_t jj = 1; dense && jj < {NR}; ++jj) dense = col_off[jr + jj] == col_off[jr] + jj;
{multiply}
                }}"""
        return (
            packers,
            f"""
        {tables(*extremes)}
        /* the whole of a (rows x depth) packed once, each column strip packed and multiplied by the task owning it */
        NF_SCRATCH(float, apack, {round_up(k * round_up(m, MR), 16)});
        {a_whole}
        for (int64_t i = {m}; i < {round_up(m, MR)}; ++i)
            for (int64_t p = 0; p < {k}; ++p) apack[(i / {MR}) * {MR} * {k} + p * {MR} + i % {MR}] = 0.0f;
        #pragma omp parallel
        {{
            NF_SCRATCH(float, bpack, {k} * {NR * together});
            float tile[{MR * NR}] __attribute__((aligned(64)));
            const int64_t ic = 0, jc = 0, mc = {m}, pc = 0, kc = {k};
            const int last_ = 1;
            /* static: each thread a contiguous run of tasks; neighbouring tasks write neighbouring
               output elements, and handed out in turn they share cache lines between the threads;
               a task packs {together} column strip(s) together (neighbours in each row read) */
            #pragma omp for schedule(static)
            for (int64_t task = 0; task < {batches * tasks}; ++task) {{
                const int64_t batch_ = task / {tasks}, j0 = task % {tasks} * {NR * together};
                {unflatten_index("batch_", batch)}
                float *restrict to_batch = outp + {offset(batch)};
                const int64_t span = {n} - j0 < {NR * together} ? {n} - j0 : {NR * together};
                {pack_and_multiply}
            }}
        }}""",
        )
    # the b block is packed by every thread, each a slice of the packer's outer loop
    pack_b_shared = "for (int64_t part = 0; part < threads_; ++part)\n                        " + pack_b(
        f"{b_outer} * part / threads_", f"{b_outer} * (part + 1) / threads_"
    )
    return (
        packers,
        f"""
        {tables()}
        NF_SCRATCH(float, bpack, {blocking.kc} * {min(blocking.nc, round_up(n, NR))});
        NF_SCRATCH(char, contiguous, {-(-min(blocking.nc, n) // NR)});
        /* row blocks: a multiple of the thread count when there are enough rows, otherwise
           the column strips are shared out too */
        int64_t mblocks = ({m} + {blocking.mc - 1}) / {blocking.mc};
        if (mblocks >= threads_) mblocks = (mblocks + threads_ - 1) / threads_ * threads_;
        const int64_t mcb = (({m} + mblocks - 1) / mblocks + {MR - 1}) / {MR} * {MR};
        mblocks = ({m} + mcb - 1) / mcb;
        for (int64_t batch_ = 0; batch_ < {batches}; ++batch_) {{
            {unflatten_index("batch_", batch)}
            float *restrict to_batch = outp + {offset(batch)};
            for (int64_t jc = 0; jc < {n}; jc += {blocking.nc}) {{
                const int64_t nc = jc + {blocking.nc} < {n} ? {blocking.nc} : {n} - jc;
                const int64_t strips = (nc + {NR - 1}) / {NR};
                int64_t jparts = mblocks >= threads_ ? 1 : (threads_ + mblocks - 1) / mblocks;
                if (jparts > strips) jparts = strips;
                const int64_t per_part = (strips + jparts - 1) / jparts * {NR};
                for (int64_t s = 0; s < strips; ++s) {{
                    const int64_t j0 = jc + s * {NR};
                    int ok = j0 + {NR} <= jc + nc;
                    for (int64_t jj = 1; ok && jj < {NR}; ++jj) ok = col_off[j0 + jj] == col_off[j0] + jj;
                    contiguous[s] = (char)ok;
                }}
                for (int64_t pc = 0; pc < {k}; pc += {blocking.kc}) {{
                    const int64_t kc = pc + {blocking.kc} < {k} ? {blocking.kc} : {k} - pc;
                    const int last_ = pc + kc >= {k};
                    #pragma omp parallel for
                    {pack_b_shared}
                    #pragma omp parallel
                    {{
                        NF_SCRATCH(float, apack, {blocking.kc} * {round_up(blocking.mc, MR)});
                        float tile[{MR * NR}] __attribute__((aligned(64)));
                        #pragma omp for schedule(static)
                        for (int64_t task = 0; task < mblocks * jparts; ++task) {{
                            const int64_t ic = (task / jparts) * mcb;
                            const int64_t mc = ic + mcb < {m} ? mcb : {m} - ic;
                            const int64_t j_first = (task % jparts) * per_part;
                            const int64_t j_end = j_first + per_part < nc ? j_first + per_part : nc;
                            {pack_a}
                            for (int64_t jr = j_first; jr < j_end; jr += {NR}) {{
                                const int64_t width = nc - jr < {NR} ? nc - jr : {NR};
                                const int dense = contiguous[jr / {NR}];
{row_strips("bpack + jr * kc")}
                            }}
                        }}
                    }}
                }}
            }}
        }}""",
    )


class OperandPacker(NamedTuple):
    """One operand's packing function, the index tables it reads (built with the
    kernel's own) and the names of those tables, its first arguments after the ranges."""

    code: str
    tables: tuple[Table, ...]
    arguments: str


def _operand_packer(
    prefix: str,
    side: str,
    width: int,
    factor: Expr,
    value: str,
    group: list[tuple[str, int]],
    depth: list[tuple[str, int]],
    batch: list[tuple[str, int]],
    side_inner: bool,
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, str],
    params: str,
    extents: dict[str, int],
) -> OperandPacker:
    """The packer of operand ``side`` (``a``: rows, ``b``: columns): through offset tables
    when the operand is an affine guarded read (``packing.affine_operand``), otherwise the
    generic packer evaluating ``value`` from the shared index tables; the function is named
    ``<prefix>_pack_<side>``."""
    name = f"{prefix}_pack_{side}"
    affine = affine_operand(factor, shapes, extents)
    if affine is None:
        generic = "row_tab" if side == "a" else "col_tab"
        return OperandPacker(_packer(name, width, group, value, depth, side_inner, params), (), f"{generic}, dep_tab")
    return OperandPacker(
        affine_packer(
            name,
            width,
            affine,
            names[affine.tensor],
            batch,
            side_inner,
            params,
            Strips(tuple(v for v, _ in group), tuple(v for v, _ in depth), extents, math.prod(shapes[affine.tensor])),
        ),
        (operand_tables(f"{side}_side", affine, group, False), operand_tables(f"{side}_dep", affine, depth, True)),
        f"{side}_side, {side}_dep",
    )


def _packer(
    name: str,
    width: int,
    variables: list[tuple[str, int]],
    value: str,
    depth: list[tuple[str, int]],
    side_inner: bool,
    params: str,
) -> str:
    """A C function packing rows (or columns) ``[start, start + size)`` of an operand
    for depth ``[pc, pc + kc)`` into ``width``-wide strips of ``buffer``
    (``strip[p * width + i % width]``), for the outer loop's range ``[lo, hi)``;
    the loops are ordered so that consecutive reads are near in memory.  It is
    compiled without auto-vectorisation: the reads are index-table lookups the
    vectoriser would turn into slow gathers."""
    target = f"buffer[(i / {width}) * {width} * kc + p * {width} + i % {width}]"
    own = _lookup("side", "start + i", variables)
    dep = _lookup("dep", "pc + p", depth)
    outer, inner = ("p", "i") if side_inner else ("i", "p")
    first, second = (dep, own) if side_inner else (own, dep)
    bound = {"p": "kc", "i": "size"}
    return f"""static NF_SCALAR void {name}(float *restrict buffer, int64_t start, int64_t size, int64_t pc, int64_t kc,
        int64_t lo, int64_t hi, const int32_t *restrict side_tab, const int32_t *restrict dep_tab{params}) {{
    for (int64_t {outer} = lo; {outer} < hi; ++{outer}) {{
        {first}
        for (int64_t {inner} = 0; {inner} < {bound[inner]}; ++{inner}) {{
            {second}
            {target} = {value};
        }}
    }}
}}"""


@lru_cache(maxsize=1024)
def _affine(
    factor: Expr, shapes: tuple[tuple[str, tuple[int, ...]], ...], extents: tuple[tuple[str, int], ...]
) -> AffineOperand | None:
    """``packing.affine_operand`` of ``factor`` (cached: every candidate mapping asks)."""
    return affine_operand(factor, dict(shapes), dict(extents))


@lru_cache(maxsize=1024)
def _read_offset(factor: Expr, shape: tuple[int, ...], extents: tuple[tuple[str, int], ...]) -> sympy.Expr:
    """The flat offset of the first read in ``factor`` in a tensor of ``shape``, simplified
    over the box of ``extents`` (cached)."""
    read = next(n for n in factor.walk() if isinstance(n, Read))
    return read_offset(read.indices, shape, dict(extents))


def _inner_is_first(
    factor: Expr,
    tensors: dict,
    first: list[tuple[str, int]],
    second: list[tuple[str, int]],
    extents: tuple[tuple[str, int], ...],
) -> bool:
    """Whether the last variable of ``first`` moves the read of ``factor`` less in
    memory than the last variable of ``second`` (so it should be the inner loop), or
    both move it by one element; ``extents`` are the op's variables'."""
    read = next(n for n in factor.walk() if isinstance(n, Read))
    linear = _read_offset(factor, tensors[read.tensor].shape, extents)

    def step(group: list[tuple[str, int]]) -> float:
        if not group:
            return math.inf
        coefficient = linear.coeff(var(group[-1][0]))
        return abs(float(coefficient)) if coefficient.is_number and coefficient != 0 else math.inf

    # a tie at unit steps goes to the side: its strips are then runs of consecutive reads, copied whole
    return step(first) < step(second) or step(first) == step(second) == 1


def _first_read(node: Expr) -> str:
    """The tensor of the first read in ``node``."""
    return next(n.tensor for n in node.walk() if isinstance(n, Read))


def _narrow(m: int, k: int, batch: list[tuple[str, int]], factor_a: Expr) -> bool:
    """Whether to pack all of ``a`` once (its rows x depth fit ``NARROW_A_BYTES``; it does
    not change with the batch) and give each task one column strip of ``b`` to pack and
    multiply by all of it: few rows (a convolution's output channels) make a block of
    ``b`` packed ahead into the shared buffer worth only a few micro-kernel calls, so it
    is better packed just before those calls, by the thread making them, while it is in
    its cache, and in one depth block the tiles are stored once."""
    fits = round_up(m, MR) * k * 4 <= NARROW_A_BYTES
    rows = MC if k > NARROW_SHALLOW else NARROW_MAX_ROWS
    return m <= rows and fits and _narrow_fits(m, k, batch, factor_a)


def _narrow_fits(m: int, k: int, batch: list[tuple[str, int]], factor_a: Expr) -> bool:
    """Whether a piece can run ``narrow`` at all: its ``a`` does not change with the batch and fits
    four times ``NARROW_A_BYTES`` (``_narrow`` asks a quarter of that where it picks it unasked)."""
    return round_up(m, MR) * k * 4 <= 4 * NARROW_A_BYTES and not index_variables(factor_a) & {v for v, _ in batch}


def _structure(wanted: str, sizes: tuple[int, int, int], batch: list[tuple[str, int]], factor_a: Expr) -> str:
    """The structure (``STRUCTURES``) of a piece of ``sizes`` (m, n, k) whose ``a`` factor is
    ``factor_a``: ``wanted`` where the piece can take it, else the estimate's (``auto``).  A
    ``narrow`` ``a`` must not change with the batch and fit four times ``NARROW_A_BYTES``; a
    ``split`` output (a copy a thread) must be at most 2^20 elements."""
    m, n, k = sizes
    if wanted == "panel":
        return wanted
    if wanted == "narrow" and _narrow_fits(m, k, batch, factor_a):
        return wanted
    if wanted == "split" and m * n <= 1 << 20:
        return wanted
    if wanted == "batched" and _batched(sizes, batch, any_size=True):
        return wanted
    return _auto_structure(sizes, batch, factor_a)


def _auto_structure(sizes: tuple[int, int, int], batch: list[tuple[str, int]], factor_a: Expr) -> str:
    """The structure the estimate picks for a piece (``_structure``'s ``auto``).  A small output
    with a long depth has its depth shared out (``split``) where it is one product (a weight
    gradient); over a batch of them (a 3x3 convolution over 128 channels of 16x16 images, the batch
    outside its columns) the tasks of ``narrow`` are every item's column strips, ``a`` packed once:
    split, each item met the threads at two barriers and shared its five depth blocks unevenly (one
    thread: 21.8 -> 19.9 ms narrow)."""
    m, n, k = sizes
    if _split_depth(m, n, k):
        items = math.prod(e for _, e in batch) * -(-n // NR)
        many = len(batch) and items >= NARROW_MIN_TASKS
        return "narrow" if many and _narrow_fits(m, k, batch, factor_a) else "split"
    if _narrow(m, k, batch, factor_a):
        return "narrow"
    return "batched" if _batched(sizes, batch) else "panel"


def _batched(sizes: tuple[int, int, int], batch: list[tuple[str, int]], any_size: bool = False) -> bool:
    """Whether each thread should take whole batch items (``batched``): at least ``BATCHED_MIN_ITEMS``
    of them, each a product of at most ``BATCHED_MAX_MACS`` (with ``any_size``, a structure asked for:
    two items or more, of any size) whose packed operands fit ``BATCHED_PACK_BYTES``."""
    m, n, k = sizes
    items = math.prod(e for _, e in batch)
    packed = (round_up(m, MR) + round_up(n, NR)) * k * 4
    if packed > BATCHED_PACK_BYTES or items < 2:
        return False
    return any_size or (items >= BATCHED_MIN_ITEMS and m * n * k <= BATCHED_MAX_MACS)


def _split_depth(m: int, n: int, k: int) -> bool:
    """Whether to share out the reduction rather than the rows: a small output (a weight
    gradient) with a long reduction has few row blocks and column strips to keep every core
    busy, and sharing them out block by block of the depth would have the threads meet at
    two barriers per block; each thread summing its own part of the depth into its own copy
    of the output meets them once."""
    return m * n <= (1 << 16) and k >= 4 * KC


def _depth_vector(
    factor_a: Expr,
    factor_b: Expr,
    shapes: dict[str, tuple[int, ...]],
    extent: dict[str, int],
    sizes: tuple[int, int, int],
    depth: list[tuple[str, int]],
) -> DepthVectorPlan | None:
    """The depth-vectorised plan (``neoflow.targets.cpu.depth_vector``) of a contraction the
    blocked kernel would run with its depth shared out, where it applies and one output
    block of columns (``NC``) holds all of them."""
    if sizes[1] > NC or not _split_depth(*sizes):
        return None
    frozen_shapes, extents = tuple(sorted(shapes.items())), tuple(sorted(extent.items()))
    return depth_vector_plan(
        _affine(factor_a, frozen_shapes, extents), _affine(factor_b, frozen_shapes, extents), sizes, depth
    )


def _partial_sums(m: int, epilogue: str) -> str:
    """C adding the threads' partial outputs (``partial``, ``threads_ x m x width_``) for
    columns ``[jc, jc + nc)`` into ``to_batch``, applying ``epilogue`` to each sum."""
    return f"""                #pragma omp parallel for
                for (int64_t i = 0; i < {m}; ++i)
                    for (int64_t j = 0; j < nc; ++j) {{
                        float sum = 0.0f;
                        for (int64_t t = 0; t < threads_; ++t) sum += partial[(t * {m} + i) * width_ + j];{epilogue}
                        to_batch[row_off[i] + col_off[jc + j]] = sum;
                    }}"""


def _depth_split_code(
    sizes: tuple[int, int, int], blocking: Blocking, open_batch: str, pack_a: str, pack_b: str, sums: str
) -> str:
    """C for the blocked kernel with its depth blocks shared out among the threads: each
    accumulates its part of the sum in its own ``m x nc`` buffer, and the buffers are then
    added up into the output by ``sums``; ``open_batch`` opens the loop over the batch points."""
    m, n, k = sizes
    return f"""
        const int64_t width_ = {min(blocking.nc, n)};
        NF_SCRATCH(float, partial, threads_ * {m} * width_);
        {open_batch}
            for (int64_t jc = 0; jc < {n}; jc += {blocking.nc}) {{
                const int64_t nc = jc + {blocking.nc} < {n} ? {blocking.nc} : {n} - jc;
                const int64_t strips = (nc + {NR - 1}) / {NR};
                memset(partial, 0, sizeof(float) * threads_ * {m} * width_);
                #pragma omp parallel
                {{
#ifdef _OPENMP
                    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
                    const int64_t me = 0, team = 1;
#endif
                    NF_SCRATCH(float, apack, {blocking.kc} * {round_up(blocking.mc, MR)});
                    NF_SCRATCH(float, bpack, {blocking.kc} * {round_up(min(blocking.nc, n), NR)});
                    float tile[{MR * NR}] __attribute__((aligned(64)));
                    float *mine = partial + me * {m} * width_;
                    const int64_t blocks = {-(-k // blocking.kc)};
                    for (int64_t block = blocks * me / team; block < blocks * (me + 1) / team; ++block) {{
                        const int64_t pc = block * {blocking.kc};
                        const int64_t kc = pc + {blocking.kc} < {k} ? {blocking.kc} : {k} - pc;
                        {pack_b}
                        for (int64_t ic = 0; ic < {m}; ic += {blocking.mc}) {{
                            const int64_t mc = ic + {blocking.mc} < {m} ? {blocking.mc} : {m} - ic;
                            {pack_a}
                            for (int64_t jr = 0; jr < nc; jr += {NR}) {{
                                const int64_t width = nc - jr < {NR} ? nc - jr : {NR};
                                for (int64_t ir = 0; ir < mc; ir += {MR}) {{
                                    nf_micro_6x16(kc, apack + ir * kc, bpack + jr * kc, tile);
                                    for (int64_t ii = 0; ii < {MR} && ir + ii < mc; ++ii)
                                        for (int64_t jj = 0; jj < width; ++jj)
                                            mine[(ic + ir + ii) * width_ + jr + jj] += tile[ii * {NR} + jj];
                                }}
                            }}
                        }}
                    }}
                }}
{sums}
            }}
        }}"""
