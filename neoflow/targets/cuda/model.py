"""The tensor-core model: a kernel plan executed in numpy as the GPU executes it.

An ``MmaKernel`` runs block row by block row and depth tile by depth tile: every
thread's share of each operand tile is gathered through the plan's load formulas
(``MmaKernel.load_coords``) and the op's own operand expressions, rounded to the
precision, into a shared-memory tile that starts as NaN (an element no thread
loads poisons the result); the warps' fragments are read out of it through the
plan's ``ldmatrix`` / tf32 address formulas composed with the PTX fragment
layouts, multiplied 16 (tf32: 8) deep at a time with fp32 accumulation, and the
accumulators leave through the plan's accumulator formula, the epilogue and the
piece's output offset, under the same guards.  A ``SimtKernel`` is the
interpreter's evaluation of its op (its CUDA is one thread per point of exactly
that arithmetic).  So every CI run checks the GPU kernels' tiling and indexing
against the interpreter without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import sympy

from neoflow.codegen.gather import OFFSET, Gather, unravel
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.interpreter import evaluate_at, evaluate_op
from neoflow.targets.cuda.plan import (
    MN_ATOM_ROWS,
    SWIZZLE_BYTES,
    WGMMA_K,
    MmaKernel,
    OpPlan,
    accumulator_coords,
    ldmatrix_a_address,
    ldmatrix_b_address,
    swizzle128,
    tf32_a_coords,
    tf32_b_coords,
)


def round_to(values: np.ndarray, storage: str) -> np.ndarray:
    """float32 ``values`` rounded as the kernel stores them: ``float16``, ``bfloat16`` and
    ``tf32`` (``cvt.rn``) to nearest even."""
    values = np.asarray(values, dtype=np.float32)
    if storage == "float16":
        return values.astype(np.float16).astype(np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    if storage == "bfloat16":
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    elif storage == "tf32":
        bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    else:
        raise ValueError(f"unknown storage {storage}")
    rounded = bits.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(values), rounded, values)


def _evaluate(expr: sympy.Expr, **env) -> np.ndarray:
    return np.asarray(index.evaluate(expr, {k: np.asarray(v, dtype=np.int64) for k, v in env.items()}))


def _a_table(kernel: MmaKernel) -> tuple[np.ndarray, np.ndarray]:
    """Tile row (m, from the fragment's first row) and column (depth, from the depth step) that
    each element ``[row, col]`` of the logical A fragment the mma multiplies comes from."""
    rows, cols = np.meshgrid(np.arange(16), np.arange(kernel.mma_shape[2]), indexing="ij")
    if not kernel.by_ldmatrix("a"):  # tf32 element by element
        lane, reg = 4 * (rows % 8) + cols % 4, rows // 8 + 2 * (cols // 4)
        r, c = tf32_a_coords()
        return _evaluate(r, lane=lane, reg=reg), _evaluate(c, lane=lane, reg=reg)
    # the mma reads register j as rows 8(j % 2) + g, columns u(j // 2) + (0 .. u-1) (PTX's
    # m16n8k16 and m16n8k8 A layouts; u elements in 16 bytes); ldmatrix.x4 fills register j
    # from matrix j, whose lines lanes 8j .. 8j + 7 address: without .trans lane 4g + t gets
    # line g, its 32-bit word t; with .trans (16-bit, a tile stored depth-major) lines 2t,
    # 2t + 1, element g of each
    unit = kernel.ldmatrix_unit
    g, j, within = rows % 8, rows // 8 + 2 * (cols // unit), cols % unit
    r, c = ldmatrix_a_address(kernel.layout("a"), unit)
    if kernel.layout("a") == "rows":
        source = 8 * j + g
        return _evaluate(r, lane=source), _evaluate(c, lane=source) + within
    source = 8 * j + within
    return _evaluate(r, lane=source) + g, _evaluate(c, lane=source)


def _b_table(kernel: MmaKernel, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Tile row (n) and column (k) that each element ``[k, n]`` of the logical B fragment comes
    from (by ``ldmatrix``: fragment ``half`` of the pair one ``ldmatrix.x4`` loads)."""
    ks, ns = np.meshgrid(np.arange(kernel.mma_shape[2]), np.arange(8), indexing="ij")
    if not kernel.by_ldmatrix("b"):  # tf32 element by element
        lane, reg = 4 * ns + ks % 4, ks // 4
        r, c = tf32_b_coords()
        return _evaluate(r, lane=lane, reg=reg), _evaluate(c, lane=lane, reg=reg)
    # register i of B fragment ``half`` is matrix 2 half + i, which the mma reads as depths
    # u i + (0 .. u-1) of column n = g (PTX's B layouts); ldmatrix as for A
    unit = kernel.ldmatrix_unit
    i, within = ks // unit, ks % unit
    r, c = ldmatrix_b_address(kernel.layout("b"), unit)
    if kernel.layout("b") == "rows":
        source = 8 * (2 * half + i) + ns
        return _evaluate(r, lane=source), _evaluate(c, lane=source) + within
    source = 8 * (2 * half + i) + within
    return _evaluate(r, lane=source) + ns, _evaluate(c, lane=source)


def _gather(kernel: MmaKernel, side: str, origins: np.ndarray, k0: int, batch_env, arrays, owner: str) -> np.ndarray:
    """The shared-memory stages of operand ``side`` for tile origins ``origins`` (one per block
    row or column) at depth ``k0``, each as laid out (``smem_index``), NaN where no thread stored."""
    view = kernel.view
    row_f, col_f, count = kernel.load_coords(side)
    width = kernel.vector(side)
    tids, elements, lanes = np.meshgrid(
        np.arange(kernel.copy_threads), np.arange(count), np.arange(width), indexing="ij"
    )
    row = _evaluate(row_f, tid=tids, element=elements, vec=lanes).reshape(kernel.copy_threads, -1)
    col = _evaluate(col_f, tid=tids, element=elements, vec=lanes).reshape(kernel.copy_threads, -1)
    flat_rows = origins[:, None, None] + row[None]
    depth = np.broadcast_to(k0 + col[None], flat_rows.shape)
    limit = view.sizes[1] if side == "a" else view.sizes[2]
    live = (flat_rows < limit) & (depth < view.sizes[3])
    gather = kernel.gather(side)
    if gather is not None:  # the kernel's index tables: offsets and guard variables
        row_table, depth_table = kernel.side_tables[side]
        rows_at, depth_at = np.where(live, flat_rows, 0), np.where(live, depth, 0)
        rest = np.asarray(index.evaluate(gather.rest, batch_env), dtype=np.int64)
        env = {OFFSET: row_table[rows_at, 0].astype(np.int64) + depth_table[depth_at, 0] + rest}
        if width > 1:  # a vector load: aligned, its elements one after another in memory
            runs = env[OFFSET].reshape(len(origins), kernel.copy_threads, count, width)
            live_runs = live.reshape(runs.shape)[..., 0]
            assert (runs[..., 0][live_runs] % width == 0).all(), "a vector load is not aligned"
            assert (np.diff(runs, axis=-1)[live_runs] == 1).all(), "a vector's elements are not adjacent"
        env.update({v: row_table[rows_at, 1 + i] for i, v in enumerate(gather.row_vars)})
        env.update({v: depth_table[depth_at, 1 + i] for i, v in enumerate(gather.depth_vars)})
        env.update(batch_env)
        flat = {**arrays, **{Gather.flat(name): arrays[name].reshape(-1) for name in gather.tensors}}
        if kernel.combined(side):  # each tensor's tile as copied (zeros where nothing is)
            stage = np.full((len(origins), kernel.stage_elements(side)), np.nan, np.float32)
            for position, name in enumerate(gather.tensors):
                values = np.where(live, flat[Gather.flat(name)][np.where(live, env[OFFSET], 0)], 0)
                stage[:, position * kernel.tile_elements(side) + kernel.place(side, row, col)] = values
            return stage
        values = evaluate_at(gather.expr, env, flat, owner, live=live)
    else:
        env = {**unravel(np.where(live, flat_rows, 0), view.m if side == "a" else view.n)}
        env.update(unravel(np.where(live, depth, 0), view.k))
        env.update(batch_env)
        values = evaluate_at(view.a if side == "a" else view.b, env, arrays, owner, live=live)
    values = round_to(np.where(live, values.astype(np.float32), np.float32(0)), kernel.storage)
    stage = np.full((len(origins), kernel.tile_elements(side)), np.nan, np.float32)  # shared memory
    stage[:, kernel.place(side, row, col)] = values
    return stage


def fragment_values(kernel: MmaKernel, side: str, stage: np.ndarray, places: np.ndarray) -> np.ndarray:
    """The operand values the warps read at stage elements ``places`` of ``stage`` (``_gather``'s):
    the elements themselves, or for a ``combined`` operand its expression of each tensor's
    element there, rounded to the precision (as the kernel computes them after ``ldmatrix``)."""
    if not kernel.combined(side):
        return stage[:, places]
    gather, size = kernel.gather(side), kernel.tile_elements(side)
    elements = {Gather.flat(name): stage[:, k * size + places] for k, name in enumerate(gather.tensors)}
    shape = next(iter(elements.values())).shape
    flat = {name: values.reshape(-1) for name, values in elements.items()}
    values = evaluate_at(gather.expr, {OFFSET: np.arange(math.prod(shape))}, flat, kernel.view.op.name)
    return round_to(values.astype(np.float32).reshape(shape), kernel.storage)


def descriptor_elements(kernel: MmaKernel, side: str, warpgroup: int, step: int) -> np.ndarray:
    """The stage element each ``[row, depth]`` of the operand a ``wgmma`` reads comes from (``a``:
    the warpgroup's 64 rows; ``b``: the block's ``block_n``), as the hardware reads a 128-byte
    swizzled 16-bit operand through the descriptor the plan gives (``MmaKernel.descriptor``):
    PTX's canonical layouts (K-major: rows 128 bytes apart in atoms of eight, atoms ``stride``
    apart; MN-major: 64 rows a 128-byte line, lines of consecutive depths 128 bytes apart in
    atoms of eight, atoms ``stride`` apart, 64-row columns ``leading`` apart), then the swizzle
    of the address's 16-byte chunk by its line within the atom."""
    start, leading, stride = (int(v) for v in kernel.descriptor(side, warpgroup, step))
    rows = MN_ATOM_ROWS if side == "a" else kernel.tiles.block_n
    mn, k = np.meshgrid(np.arange(rows), np.arange(WGMMA_K), indexing="ij")
    size = kernel.element_bytes
    if kernel.layout(side) == "rows":
        offset = (mn % 8) * SWIZZLE_BYTES + (mn // 8) * stride + k * size
    else:
        offset = (mn % MN_ATOM_ROWS) * size + (mn // MN_ATOM_ROWS) * leading + (k % 8) * SWIZZLE_BYTES
        offset = offset + (k // 8) * stride
    elements = swizzle128(start + offset, 1) // size  # the swizzle acts on byte addresses
    if elements.max() >= kernel.tile_elements(side):
        raise ValueError(f"{kernel.name}: a wgmma descriptor of operand {side} reads past its stage")
    return elements


def _wgmma_products(kernel: MmaKernel, a_tile: np.ndarray, b_tile: np.ndarray) -> np.ndarray:
    """``[gy, gx, block_m, block_n]``: a depth tile's products as the block's warpgroups' ``wgmma``
    instructions compute them from the stages through their descriptors, fp32."""
    tiles = kernel.tiles
    full = np.zeros((a_tile.shape[0], b_tile.shape[0], tiles.block_m, tiles.block_n), np.float32)
    for step in range(tiles.block_k // WGMMA_K):
        b = b_tile[:, descriptor_elements(kernel, "b", 0, step)]
        for group in range(kernel.warpgroups):
            a = a_tile[:, descriptor_elements(kernel, "a", group, step)]
            rows = slice(group * MN_ATOM_ROWS, (group + 1) * MN_ATOM_ROWS)
            full[:, :, rows] += np.einsum("ymk,xnk->yxmn", a, b, optimize=True, dtype=np.float32)
    return full


def run_mma(kernel: MmaKernel, arrays: Mapping[str, np.ndarray], out: np.ndarray, workspace=None) -> None:
    """Execute ``kernel`` on ``arrays`` (the op's inputs by name), writing into ``out`` (the
    whole output, flat) or, for a split kernel, adding into ``workspace`` (float32, flat) and
    then finishing from there."""
    view, tiles = kernel.view, kernel.tiles
    gx, gy, gz = kernel.grid
    mk = kernel.mma_shape[2]
    a_rows, a_cols = _a_table(kernel)
    b_tables = [_b_table(kernel, half) for half in range(2 if kernel.by_ldmatrix("b") else 1)]
    lanes, regs = np.meshgrid(np.arange(32), np.arange(4), indexing="ij")
    acc_row_f, acc_col_f = accumulator_coords()
    dest_row = _evaluate(acc_row_f, lane=lanes, reg=regs)
    dest_col = _evaluate(acc_col_f, lane=lanes, reg=regs)
    # the PTX accumulator layout: register i of lane 4g + t is row g + 8 (i // 2), column 2t + i % 2
    hw_row, hw_col = lanes // 4 + 8 * (regs // 2), 2 * (lanes % 4) + regs % 2
    m_origins = np.arange(gy) * tiles.block_m
    n_origins = np.arange(gx) * tiles.block_n
    owner = view.op.name
    for z in range(gz):
        batch_env = unravel(np.asarray(z // kernel.splits), view.batch) if view.batch else {}
        first = (z % kernel.splits) * kernel.split_tiles
        # a block's sets of warps (``warps_k``) each accumulate their slice of every depth tile
        sliced = np.zeros(
            (tiles.warps_k, gy, gx, tiles.warps_m, tiles.warps_n, tiles.frags_m, tiles.frags_n, 16, 8), np.float32
        )
        for kt in range(first, min(first + kernel.split_tiles, kernel.depth_tiles)):
            a_tile = _gather(kernel, "a", m_origins, kt * tiles.block_k, batch_env, arrays, owner)
            b_tile = _gather(kernel, "b", n_origins, kt * tiles.block_k, batch_env, arrays, owner)
            if kernel.wgmma:  # warp w holds rows 16w .. 16w + 15 as m16n8 fragments (PTX's wgmma D layout)
                full = _wgmma_products(kernel, a_tile, b_tile)
                fragments = full.reshape(gy, gx, tiles.warps_m, 1, 1, 16, tiles.frags_n, 8)
                sliced[0] += fragments.transpose(0, 1, 2, 3, 4, 6, 5, 7)
                continue
            for kk in range(0, tiles.block_k, mk):
                wm = np.arange(tiles.warps_m)[:, None, None, None]
                fm = np.arange(tiles.frags_m)[None, :, None, None]
                a = fragment_values(
                    kernel, "a", a_tile, kernel.smem_index("a", wm * tiles.warp_m + fm * 16 + a_rows, kk + a_cols)
                )
                wn = np.arange(tiles.warps_n)[:, None, None]
                b = np.empty((gx, tiles.warps_n, tiles.frags_n, mk, 8), np.float32)
                for f in range(tiles.frags_n):
                    if not kernel.by_ldmatrix("b"):
                        rows, cols = b_tables[0]
                        fragment_row = f * 8
                    else:  # one ldmatrix.x4 loads fragments 2p and 2p + 1
                        rows, cols = b_tables[f % 2]
                        fragment_row = (f // 2) * 16
                    places = kernel.smem_index("b", wn * tiles.warp_n + fragment_row + rows, kk + cols)
                    b[:, :, f] = fragment_values(kernel, "b", b_tile, places)
                sliced[kk // tiles.slice_k] += np.einsum(
                    "ywfik,xvgkj->yxwvfgij", a, b, optimize=True, dtype=np.float32
                )  # 16 x 8 fragments, fp32
        acc = sliced[0]
        for later in sliced[1:]:  # the slices' sums added into the first's, in order
            acc = acc + later
        _store(kernel, acc, dest_row, dest_col, hw_row, hw_col, batch_env, arrays, out, workspace)
    if kernel.splits > 1:
        _finish(kernel, arrays, out, workspace)


def _finish(kernel: MmaKernel, arrays, out: np.ndarray, workspace: np.ndarray) -> None:
    """The finishing kernel: every point of the piece from the workspace through the epilogue."""
    view = kernel.view
    _, m_size, n_size, _ = view.sizes
    flat = np.arange(kernel.finish_points, dtype=np.int64)
    env = {**unravel(flat // (m_size * n_size), view.batch)} if view.batch else {}
    env.update(unravel((flat // n_size) % m_size, view.m))
    env.update(unravel(flat % n_size, view.n))
    offsets = np.broadcast_to(np.asarray(index.evaluate(view.out_offset, env), dtype=np.int64), flat.shape)
    body = view.epilogue if view.epilogue is not None else view.reduce
    result = evaluate_at(body, env, arrays, view.op.name, reduction=workspace[offsets])
    out[offsets] = result.astype(out.dtype, copy=False)


def _output_offsets(kernel, env: dict, shape: tuple[int, ...]) -> np.ndarray:
    """Each point's output offset as the epilogue computes it: the row part plus the column part
    plus the rest (``MmaKernel.output_parts``), or the whole offset where it does not split."""
    parts = kernel.output_parts
    terms = (parts.row, parts.col, parts.rest) if parts else (kernel.view.out_offset,)
    return sum(np.broadcast_to(np.asarray(index.evaluate(t, env), dtype=np.int64), shape) for t in terms)


def _store(kernel, acc, dest_row, dest_col, hw_row, hw_col, batch_env, arrays, out, workspace) -> None:
    """The epilogue: each lane's accumulator registers to the output, where the plan's
    accumulator formula and the piece's offset say, under the row and column guards."""
    view, tiles = kernel.view, kernel.tiles
    _, m_size, n_size, _ = view.sizes
    gy, gx = acc.shape[:2]
    y = np.arange(gy)[:, None, None, None, None, None, None, None]
    x = np.arange(gx)[None, :, None, None, None, None, None, None]
    wm = np.arange(tiles.warps_m)[None, None, :, None, None, None, None, None]
    wn = np.arange(tiles.warps_n)[None, None, None, :, None, None, None, None]
    fm = np.arange(tiles.frags_m)[None, None, None, None, :, None, None, None]
    fn = np.arange(tiles.frags_n)[None, None, None, None, None, :, None, None]
    values = acc[..., hw_row, hw_col]  # [gy, gx, wm, wn, fm, fn, lane, reg]
    rows = y * tiles.block_m + wm * tiles.warp_m + fm * 16 + dest_row
    cols = x * tiles.block_n + wn * tiles.warp_n + fn * 8 + dest_col
    rows, cols = np.broadcast_arrays(rows, cols)
    live = (rows < m_size) & (cols < n_size)
    rows, cols, values = rows[live], cols[live], np.broadcast_to(values, live.shape)[live]
    env = {**unravel(rows, view.m), **unravel(cols, view.n), **batch_env}
    offsets = _output_offsets(kernel, env, rows.shape)
    if kernel.paired_stores:  # an even column and the next one go out as one aligned two-element vector
        evens = cols % 2 == 0
        neighbours = {**unravel(cols[evens] + 1, view.n), **unravel(rows[evens], view.m), **batch_env}
        second = np.asarray(index.evaluate(view.out_offset, neighbours), dtype=np.int64)
        paired = cols[evens] + 1 < n_size
        assert (offsets[evens] % 2 == 0).all(), f"{kernel.name}: a paired store is not aligned"
        assert (second[paired] == offsets[evens][paired] + 1).all(), f"{kernel.name}: paired columns lie apart"
    if kernel.splits > 1:  # each split adds its partial sums (atomically, on the GPU)
        np.add.at(workspace, offsets, values.astype(np.float32))
        return
    body = view.epilogue if view.epilogue is not None else view.reduce
    result = evaluate_at(body, env, arrays, view.op.name, reduction=values)
    out[offsets] = result.astype(out.dtype, copy=False)


def run_plan(plan: OpPlan, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The output of ``plan``'s op from its inputs ``arrays``, as its kernels compute it."""
    op = plan.op
    if not any(isinstance(k, MmaKernel) for k in plan.kernels):
        return evaluate_op(op, arrays)
    inputs = {t.name: np.ascontiguousarray(arrays[t.name], dtype=dt.numpy_dtype(t.dtype)) for t in op.inputs}
    out = np.zeros(op.output.size, dt.numpy_dtype(op.dtype))
    if not plan.zero_first:
        out[:] = np.nan  # an element no kernel writes shows up
    workspace = np.zeros(op.output.size, np.float32) if plan.workspace else None
    for kernel in plan.kernels:
        run_mma(kernel, inputs, out, workspace)
    return out.reshape(op.shape)
