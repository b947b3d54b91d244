"""Compute-intensive chains tiled together (Chimera): two contractions in one kernel.

When a fusion plan inlines one matmul into another, the op reads

    E[i, n] = ReduceAdd({l}, ReduceAdd({k}, a(i, k) * b(k, l)) * d(l, n))

(``a``, ``b``, ``d`` any read expressions of those variables).  As a plain loop
nest that recomputes the inner sum for every ``n``; stored, the intermediate
``C[i, l]`` goes to memory and back.  Here it lives in a per-thread *tile
buffer* instead, in Chimera's loop order ``m, l, k, n``::

    for each block of TM rows i (in parallel):          A's block packed once
        for each block of TL values of l:
            C[TM x TL] = A[TM x K] @ B[K x TL]           into the tile buffer
            E[TM x N] += C[TM x TL] @ D[TL x N]          E's block stays in cache
        write E's block

Both products run on the 6 x 16 register-blocked micro-kernel, computed
transposed (``C^T = B^T A^T``, ``E^T = D^T C^T``) so that the first one writes
its 6 x 16 results straight into the layout the second one streams: the tile
buffer is never reshuffled.  The second one adds into E's block in its registers
(``nf_micro_6x16_acc``: the accumulators start from the block's sums so far).
``B`` and ``D`` are packed once for all blocks.  Inside a block the micro-kernel's
wide operand stays in the L1 cache while the narrow one streams from L2: the first
product takes one strip of 16 rows of ``A^T`` at a time against every strip of
``B^T``; the second runs over ``KC`` values of ``l`` at a time, one strip of ``C^T``
(16 rows x ``KC``) against every strip of ``D^T``.  (Streaming the wide operand
instead cost the benchmark's chain a tenth of its time: 1.61 against 1.44 ms.)

``TM`` and ``TL`` minimise the chain's data movement volume for this order
(Chimera's analysis, ``data_movement``) under the constraint that every block
the inner loops touch fits in the cache (``choose_tiles``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from neoflow.codegen.c_expr import IndexPrinter, ValuePrinter, linear_index
from neoflow.codegen.hardware import AVX2
from neoflow.ir.expr import Binary, Expr, Reduce, index_variables
from neoflow.ir.op import Op
from neoflow.targets.cpu.gemm import KC, MR, NR, STEP_CYCLES
from neoflow.targets.cpu.packing import round_up

#: The per-core cache the tiles must fit (bytes): this CPU's L2.
CACHE_BYTES = AVX2.scope("L2").capacity
#: Below this many multiply-adds a chain is left to the plain loop nest.
MIN_MACS = 1 << 18


@dataclass(frozen=True)
class ChainPlan:
    """A matched chain: output row variable ``row`` (``i``), column ``col``
    (``n``), the shared reduction ``middle`` (``l``) and the inner one ``depth``
    (``k``); the three factors; tile sizes and the data movement they give
    (elements)."""

    row: str
    col: str
    middle: str
    depth: str
    factor_a: Expr
    factor_b: Expr
    factor_d: Expr
    extents: tuple[int, int, int, int]  # M, N, L, K
    tile_m: int
    tile_l: int
    movement: float

    def describe(self) -> str:
        m, n, middle, k = self.extents
        return (
            f"GEMM chain M={m} N={n} L={middle} K={k}: tiles TM={self.tile_m} (rows), TL={self.tile_l} "
            f"(intermediate columns); data movement {self.movement / 1e6:.2f} M elements"
        )


def _split_product(node: Expr) -> tuple[Expr, Expr] | None:
    if isinstance(node, Binary) and node.op == "*":
        return node.a, node.b
    return None


def data_movement(m: int, n: int, middle: int, k: int, tile_m: int, tile_l: int, threads: int = 1) -> float:
    """Elements moved between memory and the cache for order ``m, l, k, n``
    (Chimera's table): ``A`` and ``E`` once per ``l`` block, ``B`` and ``D``
    once per ``m`` block, ``C`` never.  Where one block of ``l`` covers all of
    it, the blocks of ``B`` and ``D`` are the same for every row block and stay
    in each thread's cache: they move once per thread."""
    m_blocks, l_blocks = math.ceil(m / tile_m), math.ceil(middle / tile_l)
    b_and_d_loads = m_blocks if l_blocks > 1 else min(m_blocks, threads)
    return m * k * l_blocks + (k + n) * middle * b_and_d_loads + m * n * l_blocks


def footprint(n: int, k: int, tile_m: int, tile_l: int) -> int:
    """Floats the inner loops keep in cache: the blocks of A (TM x K), B (K x TL),
    C (TM x TL), D (TL x N) and E (TM x N)."""
    return tile_m * k + k * tile_l + tile_m * tile_l + tile_l * n + tile_m * n


def choose_tiles(
    m: int, n: int, middle: int, k: int, cache_bytes: int = CACHE_BYTES, threads: int = 2
) -> tuple[int, int]:
    """``(TM, TL)``: multiples of the micro-kernel's 16 and 6 minimising
    ``data_movement`` with ``footprint`` within ``cache_bytes``, keeping at
    least two row blocks per thread, shared out evenly (load balance); of
    tilings that move as much, the one with the smallest footprint (room in the
    cache for what streams through it).  The continuous problem is
    Chimera's Lagrange-multiplier one; over these few discrete candidates an
    exhaustive search finds its exact optimum."""
    capacity = cache_bytes // 4
    rows = round_up(m, NR)
    columns = round_up(middle, MR)
    most_m = max(NR, round_up(math.ceil(rows / (2 * threads)), NR))
    best: tuple[float, int, int] | None = None
    for tile_m in range(NR, min(rows, most_m) + 1, NR):
        blocks = math.ceil(rows / tile_m)
        if blocks / (threads * math.ceil(blocks / threads)) < 0.9:
            continue  # the threads' shares of row blocks would be too uneven
        for tile_l in range(MR, columns + 1, MR):
            if footprint(n, k, tile_m, tile_l) > capacity:
                break
            key = (data_movement(m, n, middle, k, tile_m, tile_l, threads), footprint(n, k, tile_m, tile_l))
            if best is None or key < best[:2]:
                best = (*key, tile_m, tile_l)
    if best is None:
        return NR, MR
    return best[2], best[3]


def chain_plan(op: Op, threads: int | None = None) -> ChainPlan | None:
    """The chain ``op`` is (see the module docstring), with its tiles for
    ``threads`` threads (default: every core), or None."""
    if op.dtype != "float32" or any(t.dtype != "float32" for t in op.inputs) or op.scatter is not None:
        return None
    outer = op.body
    if not (isinstance(outer, Reduce) and outer.kind == "ReduceAdd" and len(outer.axes) == 1 and outer.where is None):
        return None
    product = _split_product(outer.body)
    if product is None or len(op.indices) != 2:
        return None
    inner, factor_d = product
    if not isinstance(inner, Reduce):
        inner, factor_d = factor_d, inner
    if not (isinstance(inner, Reduce) and inner.kind == "ReduceAdd" and len(inner.axes) == 1 and inner.where is None):
        return None
    parts = _split_product(inner.body)
    if parts is None or any(isinstance(n, Reduce) for n in (*parts[0].walk(), *parts[1].walk(), *factor_d.walk())):
        return None
    (middle,), (depth,) = outer.axes, inner.axes
    first, second = op.indices
    for row, col in ((first, second), (second, first)):
        for factor_a, factor_b in (parts, parts[::-1]):
            if (
                row in index_variables(factor_a)
                and index_variables(factor_a) <= {row, depth}
                and index_variables(factor_b) <= {depth, middle}
                and index_variables(factor_d) <= {middle, col}
                and col in index_variables(factor_d)
            ):
                extent = op.extent
                m, n, width, k = extent[row], extent[col], extent[middle], extent[depth]
                if m * n * width + m * width * k < MIN_MACS:
                    return None
                workers = threads or os.cpu_count() or 1
                tile_m, tile_l = choose_tiles(m, n, width, k, threads=workers)
                movement = data_movement(m, n, width, k, tile_m, tile_l, workers)
                return ChainPlan(
                    row, col, middle, depth, factor_a, factor_b, factor_d, (m, n, width, k), tile_m, tile_l, movement
                )
    return None


def chain_cycles(plan: ChainPlan) -> float:
    """Estimated cycles of the chain kernel: micro-kernel calls (``STEP_CYCLES`` a
    depth step plus about 30 to start and store), packing (2 cycles an element)
    and, per call of the second product (a ``KC`` block of L at most), loading the
    partial sums it adds to, on padded sizes."""
    m, n, middle, k = plan.extents
    rows, cols, width = round_up(m, NR), round_up(n, MR), round_up(middle, MR)
    first = (width / MR) * (rows / NR) * (STEP_CYCLES * k + 30)
    full, rest = divmod(width, plan.tile_l)
    chunks = full * math.ceil(plan.tile_l / KC) + math.ceil(rest / KC)  # calls per strip pair, KC deep at most
    second = (cols / MR) * (rows / NR) * (STEP_CYCLES * width + chunks * (30 + 12))
    packing = 2.0 * (width * k + cols * width + rows * k)
    return first + second + packing


def _pack_strips(buffer: str, width: int, rows: tuple[str, str], depth: str, guard: str, bind: str, value: str) -> str:
    """C packing an operand into ``buffer`` as strips of ``width`` rows (``[strip][depth][width]``),
    strip by strip, each written in order: rows ``rows[0]`` below ``rows[1]`` (padded to
    ``width``), depth ``dp`` below ``depth``; ``value`` (read with ``bind`` declaring its
    index variables) where ``guard`` holds, zero in the padding."""
    row, limit = rows
    return f"""for (int64_t s_ = 0; s_ < {limit}; s_ += {width})
            for (int64_t dp = 0; dp < {depth}; ++dp)
                for (int64_t {row} = s_; {row} < s_ + {width}; ++{row}) {{
                    float x = 0.0f;
                    if ({guard}) {{ {bind} x = {value}; }}
                    {buffer}[s_ * {depth} + dp * {width} + {row} - s_] = x;
                }}"""


def chain_function(op: Op, plan: ChainPlan, name: str) -> str:
    """The C function ``name`` computing ``op`` by ``plan`` (output first, then the inputs)."""
    tensors = {t.name: t for t in op.inputs}
    names = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
    printer_index = IndexPrinter(lambda v: f"v_{v}", lambda t, idx: printer.read(t, idx))
    printer = ValuePrinter(tensors, names, printer_index, lambda node: "0")
    value_a = printer(plan.factor_a, "float32")
    value_b = printer(plan.factor_b, "float32")
    value_d = printer(plan.factor_d, "float32")
    i, n, mid, k = plan.row, plan.col, plan.middle, plan.depth
    m_size, n_size, l_size, k_size = plan.extents
    padded_m, padded_n, padded_l = round_up(m_size, NR), round_up(n_size, MR), round_up(l_size, MR)
    tm, tl = plan.tile_m, plan.tile_l
    target = linear_index([f"v_{v}" for v in op.indices], op.shape)
    params = "".join(f", const float *restrict in{j}" for j in range(len(op.inputs)))
    bind_b, bind_d = f"const int64_t v_{mid} = lp, v_{k} = dp;", f"const int64_t v_{mid} = dp, v_{n} = np;"
    pack_b = _pack_strips("bt", MR, ("lp", "LP"), "K", "lp < L", bind_b, value_b)
    pack_d = _pack_strips("dt", MR, ("np", "NP"), "LP", "np < N && dp < L", bind_d, value_d)
    pack_a = _pack_strips(
        "at", NR, ("ip", "tm"), "K", "m0 + ip < M", f"const int64_t v_{i} = m0 + ip, v_{k} = dp;", value_a
    )
    pack_a = pack_a.replace("\n", "\n    ")
    return f"""void {name}(float *restrict out{params}) {{
    /* {plan.describe()} */
    enum {{ M = {m_size}, N = {n_size}, L = {l_size}, K = {k_size} }};
    enum {{ MP = {padded_m}, NP = {padded_n}, LP = {padded_l}, TM = {tm}, TL = {tl}, LC = {KC} }};
    NF_SCRATCH(float, bt, {round_up(padded_l * k_size, 16)});  /* B^T: [l/6][k][6] */
    NF_SCRATCH(float, dt, {round_up(padded_n * padded_l, 16)});  /* D^T: [n/6][l][6] */
    #pragma omp parallel
    {{  /* strip by strip, each written in order (and in one parallel region) */
        #pragma omp for nowait
        {pack_b}
        #pragma omp for
        {pack_d}
    }}
    #pragma omp parallel
    {{
        /* per thread: A^T block [i/16][k][16], the tile buffer C^T [i/16][l][16], E^T block [i/16][n][16] */
        NF_SCRATCH(float, at, {round_up(tm * k_size, 16)});
        NF_SCRATCH(float, ct, {round_up(tm * tl, 16)});
        NF_SCRATCH(float, et, {round_up(tm * padded_n, 16)});
        #pragma omp for schedule(dynamic)
        for (int64_t m0 = 0; m0 < MP; m0 += TM) {{
            const int64_t tm = MP - m0 < TM ? MP - m0 : TM;
            {pack_a}
            memset(et, 0, sizeof(float) * tm * NP);
            for (int64_t l0 = 0; l0 < LP; l0 += TL) {{
                const int64_t tl = LP - l0 < TL ? LP - l0 : TL;
                for (int64_t is = 0; is < tm; is += 16)
                    for (int64_t ls = 0; ls < tl; ls += 6)
                        nf_micro_6x16(K, bt + (l0 + ls) * K, at + is * K, ct + is * tl + ls * 16);
                for (int64_t l1 = 0; l1 < tl; l1 += LC) {{
                    const int64_t lc = tl - l1 < LC ? tl - l1 : LC;
                    for (int64_t is = 0; is < tm; is += 16)
                        for (int64_t ns = 0; ns < NP; ns += 6)
                            nf_micro_6x16_acc(lc, dt + ns * LP + (l0 + l1) * 6, ct + is * tl + l1 * 16,
                                              et + is * NP + ns * 16);
                }}
            }}
            for (int64_t ip = 0; ip < tm && m0 + ip < M; ++ip)
                for (int64_t np = 0; np < N; ++np) {{
                    const int64_t v_{i} = m0 + ip, v_{n} = np;
                    out[{target}] = et[(ip / 16) * 16 * NP + np * 16 + ip % 16];
                }}
        }}
    }}
}}
"""
