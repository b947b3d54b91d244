"""Contractions vectorised along their reduction, for small outputs with a long depth.

A weight gradient, ``dW[k, c, r, s] = ReduceAdd({n, p, q}, dY[n, k, p, q] * X[n, c, 2p + r, 2q + s])``,
has a small output (a few thousand elements) and a depth of tens of thousands, and both
operands run along the depth's last variable (``q``: one and two elements a step).  The
blocked kernel (``neoflow.targets.cpu.gemm``) packs both operands into strips across the depth,
a transposition of every element for about as many multiply-adds as the output has
columns; here the packing costs as much as the products.  Vectorised along the depth
instead, nothing is packed: for a register block of ``RA`` rows of ``a`` and ``RB``
columns of ``b``, each run of 16 depth steps is ``RA + RB`` vector loads (a step of two is
two loads and a permute) and ``RA x RB`` FMAs into accumulators that hold 16 partial sums
each.  Each thread takes a share of the depth's outer points and keeps its accumulators
in a buffer of ``16 x rows x columns`` floats between blocks of the depth; at the end their
lanes are summed into the thread's partial output, which the blocked kernel's depth-split
code adds up across the threads (with the epilogue).

Taken where the blocked kernel would share out the depth (``gemm._split_depth``), both
operands are plain affine reads (no guard, no clamp), the depth's last variable moves
each by one or two elements and is at least 16 long, and the lanes buffer is small; the
code runs with AVX-512 (the blocked kernel's depth split is the fallback without it).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from neoflow.ir.index import var
from neoflow.targets.cpu.packing import AffineOperand, round_up

LANES = 16
REGISTER_BLOCK = (4, 6)  # rows x columns of accumulators: 24 of the 32 zmm registers
MAX_LANES_BYTES = 512 * 1024  # each thread's accumulator buffer stays in its L2
#: the inner loop's operand over a block of the depth, passed over once per outer register block
INNER_BLOCK_BYTES = 64 * 1024
#: cycles of one vector load from L1/L2 and of the permute a step of two adds
LOAD_CYCLES, PERMUTE_CYCLES = 0.5, 1.0


@dataclass(frozen=True)
class DepthVectorPlan:
    """How a contraction runs vectorised along its depth: the last depth variable's
    extent (``run``), how far one step of it moves operand ``a``'s and ``b``'s reads
    (``steps``), the register block (rows of ``a``, columns of ``b``) and the operands."""

    run: int
    steps: tuple[int, int]
    block: tuple[int, int]
    a: AffineOperand
    b: AffineOperand


def depth_vector_plan(
    a: AffineOperand | None, b: AffineOperand | None, sizes: tuple[int, int, int], depth: list[tuple[str, int]]
) -> DepthVectorPlan | None:
    """The plan for a ``rows x columns x depth`` (``sizes``) contraction of operands ``a``
    and ``b`` over the ``depth`` variables (row-major), or None where it does not apply:
    an operand that is not a plain affine read, a last depth variable shorter than
    ``LANES`` or moving a read by other than one or two elements, too many outputs."""
    m, n, _ = sizes
    if a is None or b is None or a.ranges or b.ranges or a.clamps or b.clamps or not depth:
        return None
    last, run = depth[-1]
    if run < LANES:
        return None
    steps = tuple(operand.offset.coeff(var(last)) for operand in (a, b))
    if not all(isinstance(step, sympy.Integer) and int(step) in (1, 2) for step in steps):
        return None
    # the operand whose loads cost more (a step of two) takes the block's shorter side
    block = REGISTER_BLOCK if steps[0] >= steps[1] else REGISTER_BLOCK[::-1]
    if round_up(m, block[0]) * round_up(n, block[1]) * LANES * 4 > MAX_LANES_BYTES:
        return None
    return DepthVectorPlan(run, (int(steps[0]), int(steps[1])), block, a, b)


def depth_vector_cycles(plan: DepthVectorPlan, sizes: tuple[int, int, int], fma_cycles: float) -> float:
    """Estimated cycles (one core's worth of work) of ``plan`` on a ``rows x columns x
    depth`` contraction: per register block and run of 16 depth steps, its FMAs
    (``fma_cycles`` each) and its loads (a step of two: two loads and a permute)."""
    m, n, k = sizes
    ra, rb = plan.block
    runs = k // plan.run * -(-plan.run // LANES)
    blocks = -(-m // ra) * -(-n // rb)
    loads = sum(
        side * (LOAD_CYCLES if step == 1 else 2 * LOAD_CYCLES + PERMUTE_CYCLES)
        for side, step in zip(plan.block, plan.steps, strict=True)
    )
    return blocks * runs * (ra * rb * fma_cycles + loads)


def _run_body(plan: DepthVectorPlan, count: int | None) -> str:
    """C for one run of 16 (or the last ``count``) depth steps at ``e``: the block's loads and
    FMAs.  A compacted operand (a step of two, copied into ``<side>_run``) is read with
    aligned loads, its lanes past the run zero; the other with unaligned (or masked) ones."""
    ra, rb = plan.block
    loads = []
    for side, step in zip("ab", plan.steps, strict=True):
        pointer = f"p{side}{{}} + d{side} + e"
        if step != 1:
            loads.append(f"_mm512_load_ps({pointer})")
        elif count is None:
            loads.append(f"_mm512_loadu_ps({pointer})")
        else:
            loads.append(f"nf_load_run({pointer}, 1, {count})")
    lines = [f"const __m512 x{r} = {loads[0].format(r)};" for r in range(ra)]
    for c in range(rb):
        fmas = " ".join(f"c{r}_{c} = _mm512_fmadd_ps(x{r}, y, c{r}_{c});" for r in range(ra))
        lines.append(f"{{ const __m512 y = {loads[1].format(c)}; {fmas} }}")
    return "\n                                    ".join(lines)


def _compact(side: str, count: int, padded: int, plan: DepthVectorPlan, depth_block: int) -> str:
    """C copying operand ``side``'s reads (a step of two) for the depth block's outer
    points ``[o, o_end)`` into ``<side>_run``: each of its ``padded`` rows (the ones past
    ``count`` repeat the last) a run of ``run`` consecutive floats, zero-padded to whole vectors."""
    run = plan.run
    full, tail, stride = run // LANES * LANES, run % LANES, round_up(run, LANES)
    tail_copy = ""
    if tail:
        copy = f"_mm512_store_ps(to + {full}, nf_load_run(row + {full * 2}, 2, {tail}));"
        tail_copy = f"\n                            {copy}"
    return f"""for (int64_t i = 0; i < {padded}; ++i) {{
                        const float *from = {side}_at + {side}_side[0][i < {count} ? i : {count - 1}];
                        for (int64_t oo = o; oo < o_end; ++oo) {{
                            const float *row = from + {side}_dep[0][oo];
                            float *to = {side}_run + (i * {depth_block} + (oo - o)) * {stride};
                            for (int64_t e = 0; e < {full}; e += {LANES})
                                _mm512_store_ps(to + e, nf_load_pairs(row + e * 2));{tail_copy}
                        }}
                    }}"""


def _pointers(side: str, index: str, count: int, block: int, compacted: bool, depth_block: int, stride: int) -> str:
    """C declaring the register block's ``block`` row pointers of operand ``side`` from row ``index``."""
    if compacted:
        return " ".join(
            f"const float *restrict p{side}{r} = {side}_run + ({index} + {r}) * {depth_block * stride};"
            for r in range(block)
        )
    return " ".join(
        f"const float *restrict p{side}{r} = {side}_at + {side}_side[0][{index} + {r} < {count} ? {index} + {r} : "
        f"{count - 1}];"
        for r in range(block)
    )


def depth_vector_code(
    plan: DepthVectorPlan,
    sizes: tuple[int, int, int],
    inputs: tuple[str, str],
    bases: tuple[str, str],
    open_batch: str,
    sums: str,
) -> str:
    """C computing the contraction with ``plan`` into each thread's ``partial`` output
    (``threads_ x rows x width_``, declared by the caller), reading operand ``a`` from
    ``inputs[0]`` through the tables ``a_side`` (by row) and ``a_dep`` (by outer point of
    the depth: every depth variable but the last, which is zero) and ``b`` likewise, at the
    batch offsets ``bases``; ``open_batch`` is the C opening the loop over the batch points
    (declaring the batch variables and ``to_batch``); ``sums`` is the C adding the
    threads' partial outputs up into ``to_batch``.

    An operand with a step of two is first compacted, per block of the depth, into runs
    of consecutive floats (all of it read once, then by aligned loads).  The register
    blocks of the other operand (read in place) are the outer loop, so that each of its
    elements is fetched from memory once and stays in L1 while the inner loop passes
    over all of the compacted one (where both or neither are compacted, the side with
    fewer rows is the inner one); the depth block is as long as keeps the inner side
    within ``INNER_BLOCK_BYTES``, so that each thread's accumulators, stored in ``lanes``
    between depth blocks, are read and written back seldom (once per outer point, they
    took a third of the four-op weight gradient's time)."""
    m, n, k = sizes
    ra, rb = plan.block
    mp, np_ = round_up(m, ra), round_up(n, rb)
    outer = k // plan.run
    full, tail, stride = plan.run // LANES * LANES, plan.run % LANES, round_up(plan.run, LANES)
    compacted = tuple(step != 1 for step in plan.steps)
    inner_is_b = compacted[1] if compacted[0] != compacted[1] else np_ <= mp
    depth_block = max(1, min(outer, INNER_BLOCK_BYTES // ((np_ if inner_is_b else mp) * stride * 4)))
    accumulators = [f"c{r}_{c}" for r in range(ra) for c in range(rb)]
    load_cells = " ".join(f"__m512 {a} = _mm512_load_ps(cell + {i * LANES});" for i, a in enumerate(accumulators))
    store_cells = " ".join(f"_mm512_store_ps(cell + {i * LANES}, {a});" for i, a in enumerate(accumulators))
    scratch, compaction, offsets = [], [], []
    for side, count, padded, flag in (("a", m, mp, compacted[0]), ("b", n, np_, compacted[1])):
        if flag:
            size = padded * depth_block * stride
            scratch.append(f"NF_SCRATCH(float, {side}_run, {size});")
            scratch.append(f"memset({side}_run, 0, sizeof(float) * {size});")
            compaction.append(_compact(side, count, padded, plan, depth_block))
            offsets.append(f"d{side} = (oo - o) * {stride}")
        else:
            offsets.append(f"d{side} = {side}_dep[0][oo]")
    a_loop = f"""for (int64_t ib = 0; ib < {mp}; ib += {ra}) {{
                        {_pointers("a", "ib", m, ra, compacted[0], depth_block, stride)}"""
    b_loop = f"""for (int64_t jb = 0; jb < {np_}; jb += {rb}) {{
                        {_pointers("b", "jb", n, rb, compacted[1], depth_block, stride)}"""
    loops = (a_loop, b_loop) if inner_is_b else (b_loop, a_loop)
    tail_code = ""
    if tail:
        tail_code = f"""
                                {{
                                    const int64_t e = {full};
                                    {_run_body(plan, tail)}
                                }}"""
    return f"""
        const int64_t width_ = {n};
        NF_SCRATCH(float, partial, threads_ * {m} * width_);
        {open_batch}
            const float *restrict a_at = {inputs[0]} + ({bases[0]});
            const float *restrict b_at = {inputs[1]} + ({bases[1]});
            const int64_t jc = 0, nc = {n};  /* all columns in one block, as the threads' sums read them */
            /* each thread a share of the depth's outer points; 16 partial sums an output in lanes */
            #pragma omp parallel
            {{
#ifdef _OPENMP
                const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
                const int64_t me = 0, team = 1;
#endif
                NF_SCRATCH(float, lanes, {mp * np_ * LANES});
                memset(lanes, 0, sizeof(float) * {mp * np_ * LANES});
                {" ".join(scratch)}
                const int64_t first = {outer} * me / team, end = {outer} * (me + 1) / team;
                for (int64_t o = first; o < end; o += {depth_block}) {{
                    const int64_t o_end = o + {depth_block} < end ? o + {depth_block} : end;
                    {" ".join(compaction)}
                    {loops[0]}
                        {loops[1]}
                            float *restrict cell = lanes + (ib * {np_} + jb * {ra}) * {LANES};
                            {load_cells}
                            for (int64_t oo = o; oo < o_end; ++oo) {{
                                const int64_t {", ".join(offsets)};
                                for (int64_t e = 0; e < {full}; e += {LANES}) {{
                                    {_run_body(plan, None)}
                                }}{tail_code}
                            }}
                            {store_cells}
                        }}
                    }}
                }}
                /* the lanes summed into this thread's partial output */
                float *restrict mine = partial + me * {m} * width_;
                for (int64_t i = 0; i < {m}; ++i)
                    for (int64_t j = 0; j < {n}; ++j) {{
                        const int64_t ib = i / {ra} * {ra}, jb = j / {rb} * {rb};
                        const float *cell = lanes + (ib * {np_} + jb * {ra} + (i - ib) * {rb} + (j - jb)) * {LANES};
                        mine[i * width_ + j] = _mm512_reduce_add_ps(_mm512_load_ps(cell));
                    }}
            }}
{sums}
        }}"""
