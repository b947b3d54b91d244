"""Kernel plans for tensor-core GPUs: what the CUDA emitter renders and the tensor-core model executes.

A graph op becomes one or more kernels:

* ``MmaKernel``: one dense piece of a contraction (``codegen.implicit_gemm``) as an
  implicit matrix product on ``mma.sync``.  A grid of ``(⌈N/BN⌉, ⌈M/BM⌉, batch)``
  thread blocks; each block walks the depth in tiles of ``BK``, every thread
  gathering its share of the operand tiles from the tensors through the op's own
  index maps and guards (rounded to the MMA's precision) into registers, then into
  one of two shared-memory stages while the warps multiply the other; each warp
  owns a ``WM x WN`` tile of ``16 x 8`` accumulator fragments, loaded with
  ``ldmatrix`` (16-bit operands) or element by element (tf32); the epilogue
  applies the op's element-wise tail to each accumulator and stores it where the
  piece's output offset says.
* ``SimtKernel``: any op, one thread per output point (reductions summed in the
  thread), or for a scatter op one thread per source point adding atomically.

The index arithmetic both sides need (which tile element a thread loads, which
shared-memory row a lane hands ``ldmatrix``, which accumulator a register holds)
is here as sympy expressions of the thread's coordinates: the emitter prints
them, the model evaluates them, so the model checks the very formulas the GPU runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache, partial

import numpy as np
import sympy

from neoflow.codegen.gather import OFFSET, Gather, gather_plan, gather_tables
from neoflow.codegen.hardware import TENSOR_CORE
from neoflow.codegen.implicit_gemm import GemmView, covers_output, gemm_views
from neoflow.codegen.strided import strided_axes
from neoflow.errors import CompileError
from neoflow.fusion.work import op_work
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import Reduce, index_variables
from neoflow.ir.interpreter import evaluate_at
from neoflow.ir.op import Op
from neoflow.ir.simplify import read_offset
from neoflow.targets.cache import table_digest
from neoflow.targets.cuda import tuning
from neoflow.targets.cuda.timing import H100, predict_kernel

#: precision name -> (operand storage dtype, MMA shape m, n, k); ``fp32`` runs contractions on SIMT cores
PRECISIONS: dict[str, tuple[str, tuple[int, int, int]] | None] = {
    "fp16": ("float16", (16, 8, 16)),
    "bf16": ("bfloat16", (16, 8, 16)),
    "tf32": ("tf32", (16, 8, 8)),
    "fp32": None,
}
DEFAULT_PRECISION = "tf32"
#: the architecture plans are made for where none is named: the H100 the timing model describes
DEFAULT_ARCH = "sm_90"

LANE, TID, REG, ELEMENT, VEC = sympy.symbols("lane tid reg element vec", integer=True, nonnegative=True)
#: bytes one vector load of a gathered operand moves
VECTOR_BYTES = 16
#: shared-memory stages of a kernel whose operands are copied by cp.async
DIRECT_STAGES = 4


def check_precision(precision: str) -> str:
    """``precision`` when it is one of ``PRECISIONS``, else a ``CompileError``."""
    if precision not in PRECISIONS:
        raise CompileError(f"unknown precision '{precision}' (available: {', '.join(PRECISIONS)})")
    return precision


@dataclass(frozen=True)
class Tiles:
    """A block tile ``block_m x block_n`` stepping ``block_k`` deep, ``warps_m x warps_n`` warps, and
    ``warps_k`` such sets of warps each multiplying its slice of every depth tile (``slice_k`` deep)
    into accumulators of its own, summed through shared memory at the end: more warps to hide one
    another's latency where a product has few output tiles for its depth (sliced depth)."""

    block_m: int
    block_n: int
    block_k: int
    warps_m: int
    warps_n: int
    warps_k: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.warps_k

    @property
    def slice_k(self) -> int:
        """The depth of a depth tile each set of warps multiplies."""
        return self.block_k // self.warps_k

    @property
    def warp_m(self) -> int:
        return self.block_m // self.warps_m

    @property
    def warp_n(self) -> int:
        return self.block_n // self.warps_n

    @property
    def frags_m(self) -> int:
        """16-row accumulator fragments of a warp's tile, down."""
        return self.warp_m // 16

    @property
    def frags_n(self) -> int:
        """8-column accumulator fragments of a warp's tile, across."""
        return self.warp_n // 8


#: the block tiles a plan chooses among (the timing model picks one per piece): warp tiles of 32 x 32,
#: 32 accumulators a thread (64 x 32 warp tiles spilled registers with the operand gathers' index arithmetic;
#: a one-warp 32 x 32 tile, eight vectors of each operand a thread, spilled 124 bytes under NVRTC 13.0)
TILE_CHOICES = (
    Tiles(128, 64, 32, 4, 2),
    Tiles(64, 128, 32, 2, 4),
    Tiles(64, 64, 32, 2, 2),
    Tiles(32, 64, 32, 1, 2),
    Tiles(64, 32, 32, 2, 1),
)
#: tiles only a kernel copying its operands by cp.async may take (64 x 32 warp tiles: the register
#: path's gathers would spill)
DIRECT_TILES = (Tiles(128, 128, 32, 2, 4), Tiles(128, 128, 64, 2, 4), Tiles(128, 64, 64, 4, 2))
#: warp layouts only the tuner tries (cp.async kernels): the timing model does not tell them from the
#: layouts above, but alone on an H200 some ran faster for capsule28's tf32 step (64 x 64 tiles of two
#: 64 x 32 warp tiles, the depth tile sliced in two: its forward 52.7 -> 45.7 us, its second weight
#: gradient 70.0 -> 57.8; 64 x 32 tiles sliced in four: its first weight gradient 25.4 -> 18.6 us).
#: Block rows that are no power of two fill more of the GPU's 132 SMs where 128-row tiles leave many
#: idle: capsule28's forward (9216 x 128 outputs) in 72 tiles of 128 x 128 left 60 SMs idle; in 116
#: of 80 x 128 (one warp down, warp-specialised) its tuned step took 166.4 -> 156.7 us on an H200
TUNER_TILES = (
    Tiles(80, 128, 32, 1, 4),
    Tiles(96, 128, 32, 2, 4),
    Tiles(128, 64, 32, 2, 2),
    Tiles(64, 64, 32, 1, 2, 2),
    Tiles(64, 64, 32, 2, 2, 2),
    Tiles(128, 64, 32, 4, 2, 2),
    Tiles(64, 32, 32, 2, 1, 4),
    Tiles(32, 64, 32, 1, 2, 4),
)
#: shared memory rows are padded by this many bytes (one 16-byte vector) against bank conflicts
ROW_PAD_BYTES = 16
#: the tiles of a Hopper ``wgmma`` kernel: two warpgroups (eight warps) one above the other, each a
#: 64 x ``block_n`` tile of ``m64n<block_n>k16`` instructions; 64 16-bit elements deep (one 128-byte
#: swizzle line); measured on an H100 at 4096^3 and 8192^3, 128 x 192 tiles ran 20-25 % slower than 128 x 256
WGMMA_TILES = (Tiles(128, 256, 64, 8, 1), Tiles(128, 128, 64, 8, 1))
#: the most shared-memory stages a ``wgmma`` kernel keeps
WGMMA_MAX_STAGES = 8
#: the architectures whose plans may use ``wgmma`` (built as ``sm_90a``)
WGMMA_ARCHS = (DEFAULT_ARCH,)
#: a ``wgmma`` operand tile's lines are 128 bytes, swizzled in atoms of 8 lines (``SWIZZLE_BYTES``,
#: ``ATOM_BYTES``); an MN-major tile is cut into columns of 64 rows (``MN_ATOM_ROWS``)
SWIZZLE_BYTES, ATOM_BYTES, MN_ATOM_ROWS = 128, 1024, 64
#: the depth of one ``wgmma`` instruction on 16-bit operands
WGMMA_K = 16
#: threads of a ``wgmma`` kernel's producer warpgroup, which copies the operand tiles while the
#: other warpgroups multiply (warp specialisation; stages handed over through mbarriers)
PRODUCER_THREADS = 128


@lru_cache(maxsize=256)
def pointwise_gather(gather: Gather, op: Op) -> bool:
    """Whether ``gather``'s operand (of ``op``) is a function of its tensors' elements at the
    gathered offset alone, as ``G * [A > 0]`` is: no guard or index variable besides the offset,
    no reduction, and zero where every element is zero (a copy's zero fill past the tensor's
    rows or depth then yields the zero operand the matrix product needs there)."""
    expr = gather.expr
    if gather.row_vars or gather.depth_vars or any(isinstance(node, Reduce) for node in expr.walk()):
        return False
    if index_variables(expr) - {OFFSET}:
        return False
    dtypes = {t.name: t.dtype for t in op.inputs}
    zeros = {Gather.flat(name): np.zeros(1, dt.numpy_dtype(dtypes[name])) for name in gather.tensors}
    value = evaluate_at(expr, {OFFSET: np.zeros(1, np.int64)}, zeros, op.name)
    return bool(np.all(value == 0))


def swizzle128(element, element_bytes: int = 2):
    """The shared-memory element where logical element ``element`` of a 1024-byte-aligned tile
    lies under the 128-byte swizzle (``Swizzle<3,4,3>``: the 16-byte chunk of a 128-byte line
    XOR the line's index within its atom of eight), on ints or numpy arrays."""
    byte = element * element_bytes
    return (byte ^ (((byte >> 7) & 7) << 4)) // element_bytes


@dataclass(frozen=True)
class OutputParts:
    """A piece's output offset as the sum of its terms in the row variables (``row``), those in the
    column variables (``col``) and the rest (``rest``: the batch variables and the constant)."""

    row: sympy.Expr
    col: sympy.Expr
    rest: sympy.Expr


def output_parts(view: GemmView) -> OutputParts | None:
    """``view.out_offset`` as ``OutputParts``; None where a term mixes row and column variables."""
    rows = {index.var(v) for v, _ in view.m}
    cols = {index.var(v) for v, _ in view.n}
    parts = [sympy.Integer(0)] * 3
    for term in sympy.Add.make_args(sympy.expand(view.out_offset)):
        free = term.free_symbols
        side = 0 if free and free <= rows else 1 if free and free <= cols else 2
        if side == 2 and free & (rows | cols):
            return None
        parts[side] += term
    return OutputParts(*parts)


@dataclass(frozen=True)
class MmaKernel:
    """One dense piece of a contraction on ``mma.sync``: the ``view``, the ``tiles``, the
    ``precision``, and for each operand whether its tile is loaded row-fastest (``True``:
    consecutive threads take consecutive rows, as when the row index runs along memory)
    or depth-fastest."""

    name: str
    view: GemmView
    tiles: Tiles
    precision: str
    a_rows_fastest: bool
    b_rows_fastest: bool
    a_gather: Gather | None = None
    b_gather: Gather | None = None
    splits: int = 1
    a_vector: int = 1
    b_vector: int = 1
    a_lanes_across: bool = False
    b_lanes_across: bool = False
    wgmma: bool = False
    specialized: bool = False

    def gather(self, side: str) -> Gather | None:
        return self.a_gather if side == "a" else self.b_gather

    def rows_fastest(self, side: str) -> bool:
        return self.a_rows_fastest if side == "a" else self.b_rows_fastest

    def lanes_across(self, side: str) -> bool:
        """Whether consecutive threads take consecutive vectors across the vectors' direction
        (the depth for vectors along the rows, the rows for vectors along the depth) rather than
        along it: where memory runs that way (a weight whose vectors run along its output
        channels but whose depth lies contiguous behind them), a warp's copies then touch a few
        whole lines instead of a sector each."""
        return self.a_lanes_across if side == "a" else self.b_lanes_across

    @cached_property
    def side_tables(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per gathered operand, its row table and its depth table (``gather_tables``)."""
        return {side: gather_tables(self.view, side, self.gather(side)) for side in ("a", "b") if self.gather(side)}

    def depth_stride(self, side: str) -> int | None:
        """``s`` where operand ``side``'s depth-table offsets are ``s * k`` for every depth ``k`` and its
        guard reads no depth variable (a plain matrix's depth, or one whose variables flatten
        into it): a copy then computes its depth offset rather than reading the table (per depth
        tile, the table's reads were a wgmma kernel's producer's bound: 0.33 -> 0.26 ms at 4096^3)."""
        gather = self.gather(side)
        if gather is None or gather.depth_vars:
            return None
        offsets = self.side_tables[side][1][: self.view.sizes[3], 0].astype(np.int64)
        stride = int(offsets[1] - offsets[0]) if len(offsets) > 1 else 0
        return stride if (offsets == stride * np.arange(len(offsets))).all() else None

    @property
    def tables(self) -> tuple[np.ndarray, ...]:
        """The index tables the kernel takes after the op's tensors: ``side_tables`` in order."""
        return tuple(table for pair in self.side_tables.values() for table in pair)

    @property
    def mma_shape(self) -> tuple[int, int, int]:
        return PRECISIONS[self.precision][1]  # type: ignore[index]

    @property
    def storage(self) -> str:
        """The dtype operands are held in, in shared memory (``tf32``: float32 bits rounded to tf32)."""
        return PRECISIONS[self.precision][0]  # type: ignore[index]

    @property
    def element_bytes(self) -> int:
        return 4 if self.storage == "tf32" else 2

    def layout(self, side: str) -> str:
        """How operand ``side``'s tile lies in shared memory: ``rows`` (``[rows][block_k]``, the
        depth contiguous) or, for an operand loaded row-fastest, ``depth`` (``[block_k][rows]``):
        consecutive threads then store to consecutive addresses, and ``ldmatrix.trans`` (or, for
        tf32, scalar loads) hands the warps their fragments."""
        return "depth" if self.rows_fastest(side) else "rows"

    def by_ldmatrix(self, side: str) -> bool:
        """Whether the warps load operand ``side``'s fragments with ``ldmatrix`` (16-bit operands;
        tf32 ones in the ``rows`` layout, whose lines hold four whole elements) rather than
        element by element."""
        return self.storage != "tf32" or self.layout(side) == "rows"

    @property
    def ldmatrix_unit(self) -> int:
        """Elements in one 16-byte line of an ``ldmatrix`` matrix."""
        return 16 // self.element_bytes

    def tile_rows(self, side: str) -> int:
        return self.tiles.block_m if side == "a" else self.tiles.block_n

    def stride(self, side: str) -> int:
        """Elements between consecutive lines of operand ``side``'s tile (a line padded by
        ``ROW_PAD_BYTES`` against bank conflicts, twice that for fragments loaded element by element;
        a ``wgmma`` tile's lines are unpadded, 128 bytes)."""
        if self.wgmma:
            return SWIZZLE_BYTES // self.element_bytes
        pad = ROW_PAD_BYTES // self.element_bytes
        if not self.by_ldmatrix(side):
            # tf32 fragments loaded element by element: lane (row g, depth t) reads line t at g, so lines
            # 8 banks apart keep a warp's 32 reads on 32 banks (4 apart, a 16-byte pad, conflicted 2.4-way)
            pad = 2 * pad
        return (self.tiles.block_k if self.layout(side) == "rows" else self.tile_rows(side)) + pad

    def tile_elements(self, side: str) -> int:
        """Elements of one tensor's tile of operand ``side`` in a stage, padding included."""
        if self.wgmma:
            return self.tile_rows(side) * self.tiles.block_k
        lines = self.tile_rows(side) if self.layout(side) == "rows" else self.tiles.block_k
        return lines * self.stride(side)

    def combined(self, side: str) -> bool:
        """Whether operand ``side`` is computed as the warps load their fragments: a direct kernel
        copies each tensor of a pointwise gather (``pointwise_gather``: a gradient and the
        activation masking it, say) into its own tile, as it is, and applies the operand's
        expression to the elements it reads back (then rounds them to the precision)."""
        gather = self.gather(side)
        return self.direct and gather is not None and not gather.plain

    def copies(self, side: str) -> int:
        """Tensors whose tiles a stage of operand ``side`` holds, one after another: those of a
        ``combined`` operand, else one."""
        return len(self.gather(side).tensors) if self.combined(side) else 1  # type: ignore[union-attr]

    def stage_elements(self, side: str) -> int:
        """Elements of one stage of operand ``side``: its ``copies`` tiles."""
        return self.copies(side) * self.tile_elements(side)

    def smem_index(self, side: str, row, col):
        """Where tile element ``(row, col)`` (row, depth) of operand ``side`` lies in its stage,
        before a ``wgmma`` tile's swizzle (``place``).  A ``wgmma`` tile is K-major (``rows``: a
        128-byte line a row) or MN-major (``depth``: columns of ``MN_ATOM_ROWS`` rows, each a
        128-byte line a depth).  A tf32 tile read element by element (``depth``, not ``by_ldmatrix``)
        swaps the 16-byte chunk pairs of depth lines 4-7 of every eight (below)."""
        if self.wgmma and self.layout(side) == "depth":
            line = self.stride(side)
            return (row // MN_ATOM_ROWS) * (MN_ATOM_ROWS * self.tiles.block_k) + col * line + row % MN_ATOM_ROWS
        if self.layout(side) == "rows":
            return row * self.stride(side) + col
        if not self.by_ldmatrix(side):
            # tf32 fragments read element by element take lines 8 banks apart (``stride``), so a quarter
            # warp's 16-byte copies into eight neighbouring depth lines would meet two by two (lines d and
            # d + 4): lines 4-7 of every eight swap the 16-byte chunks of each pair (``row ^ 4``)
            row = row + 4 * ((col // 4) % 2) * (1 - 2 * ((row // 4) % 2))
        return col * self.stride(side) + row

    def place(self, side: str, row, col):
        """``smem_index`` swizzled as a ``wgmma`` tile is (numpy or ints): the element a copy writes."""
        logical = self.smem_index(side, row, col)
        return swizzle128(logical, self.element_bytes) if self.wgmma else logical

    @property
    def has_producer(self) -> bool:
        """Whether a warpgroup of its own copies the operand tiles while the tiles' warps multiply:
        a ``wgmma`` kernel, or a ``specialized`` ``mma.sync`` one (stages handed over through mbarriers)."""
        return self.wgmma or self.specialized

    @property
    def copy_threads(self) -> int:
        """Threads that copy the operand tiles: the producer warpgroup (``has_producer``), else
        every thread of the block."""
        return PRODUCER_THREADS if self.has_producer else self.tiles.threads

    @property
    def block_threads(self) -> int:
        """Threads of a block: the tiles' warps, and a producer warpgroup after them (``has_producer``)."""
        return self.tiles.threads + (PRODUCER_THREADS if self.has_producer else 0)

    @cached_property
    def paired_stores(self) -> bool:
        """Whether the epilogue stores the outputs (16-bit or float32) two columns at a time: a
        lane's registers ``2p`` and ``2p + 1`` are neighbouring columns (an even one first,
        ``accumulator_coords``), side by side in memory and aligned to the pair where the output
        offset moves by one along the innermost column variable (of even extent) and by an even
        number along every other.  A split kernel's float32 workspace lies as the output does: its
        pairs are added as one ``float2`` (``red.global.add.v2.f32`` on Hopper)."""
        view = self.view
        if (self.splits == 1 and view.op.dtype not in ("float16", "bfloat16", "float32")) or not view.n:
            return False
        name, extent = view.n[-1]
        steps = unit_run_steps(view.out_offset, name, [v for v, _ in (*view.m, *view.n, *view.batch)])
        return extent % 2 == 0 and steps is not None and all(step % 2 == 0 for step in steps)

    @cached_property
    def output_parts(self) -> OutputParts | None:
        """``output_parts`` of the view: the epilogue computes the row part once a row, the
        column part once a column, and adds them for each element."""
        return output_parts(self.view)

    @property
    def warpgroups(self) -> int:
        """Warpgroups (four warps) of a ``wgmma`` kernel, one above the other, 64 rows each."""
        return self.tiles.warps_m // 4

    def descriptor(self, side: str, warpgroup, step) -> tuple:
        """``(start, leading, stride)`` of the shared-memory matrix descriptor with which a
        ``wgmma`` kernel's warpgroup ``warpgroup`` reads operand ``side`` at depth step ``step``
        (``WGMMA_K`` deep): the start's byte offset in the stage, and the leading and stride
        byte offsets (PTX's canonical 128-byte-swizzled layouts: K-major, 8-row atoms
        ``stride`` apart, ``leading`` unused; MN-major, 64-row columns ``leading`` apart and
        8-deep atoms ``stride`` apart).  B is the block's whole ``block_n``."""
        rows = MN_ATOM_ROWS * warpgroup if side == "a" else 0
        if self.layout(side) == "rows":
            start = rows * SWIZZLE_BYTES + step * WGMMA_K * self.element_bytes
            return start, 16, ATOM_BYTES
        start = rows * self.tiles.block_k * self.element_bytes + step * WGMMA_K * SWIZZLE_BYTES
        return start, MN_ATOM_ROWS * self.tiles.block_k * self.element_bytes, ATOM_BYTES

    @property
    def grid(self) -> tuple[int, int, int]:
        """Blocks across ``n``, down ``m``, and over the batch times the depth's splits."""
        batch, m, n, _ = self.view.sizes
        return (-(-n // self.tiles.block_n), -(-m // self.tiles.block_m), batch * self.splits)

    @property
    def depth_tiles(self) -> int:
        return -(-self.view.sizes[3] // self.tiles.block_k)

    @property
    def finish_points(self) -> int:
        """Points of the piece (its output elements) the finishing kernel of a split kernel computes."""
        return math.prod(self.view.sizes[:3])

    @property
    def split_tiles(self) -> int:
        """Depth tiles of one split (the last split may have fewer): with ``splits`` > 1 each
        block adds the sum of its share of the depth into the float32 workspace, atomically."""
        return -(-self.depth_tiles // self.splits)

    @property
    def shared_bytes(self) -> int:
        """``stages`` stages of both operand tiles (and a ``wgmma`` kernel's mbarriers after them:
        per stage, one that its copies have landed and one that its multiplies are done), or where
        more, the float32 sums of a sliced depth's slices past the first (``Tiles.warps_k``)."""
        tiles = self.stages * (self.stage_elements("a") + self.stage_elements("b")) * self.element_bytes
        sums = (self.tiles.warps_k - 1) * self.tiles.block_m * self.tiles.block_n * 4
        return max(tiles + (2 * 8 * self.stages if self.has_producer else 0), sums)

    @property
    def direct(self) -> bool:
        """Whether both operand tiles are copied from the tensors into shared memory as they are,
        by ``cp.async`` in a ``DIRECT_STAGES``-deep pipeline: each operand a table-gathered read
        (zeros where a guard on the read alone fails) or a ``pointwise_gather`` of tensors
        (``combined``), in vectors, of the storage dtype (or float32 for tf32, rounded as its
        fragments are loaded).  Otherwise every element goes through registers, converted, two
        stages deep."""
        return all(self._direct_side(side) for side in ("a", "b"))

    def _direct_side(self, side: str) -> bool:
        gather = self.gather(side)
        if gather is None or not (gather.plain or pointwise_gather(gather, self.view.op)):
            return False
        dtypes = {t.dtype for t in self.view.op.inputs if t.name in gather.tensors}
        if len(dtypes) > 1:
            return False
        dtype = dtypes.pop()
        itemsize = dt.numpy_dtype(dtype).itemsize
        if self.vector(side) * itemsize < 4:
            return False  # cp.async copies 4, 8 or 16 bytes
        if self.vector(side) * itemsize == 4 and self.copy_threads < 128:
            return False  # scalar copies, many a thread: spilled under NVRTC 13.0 for sm_80 (32x64, 2 warps)
        return dtype == self.storage or (dtype == "float32" and self.storage == "tf32")

    def copy_bytes(self, side: str) -> int:
        """Bytes one load (vector) of operand ``side`` moves."""
        return self.vector(side) * self.element_bytes

    @property
    def stages(self) -> int:
        """Shared-memory stages of the operand tiles: a ``wgmma`` kernel's as many as a block's
        shared memory holds (at most ``WGMMA_MAX_STAGES``: the producer runs that far ahead)."""
        if self.wgmma:
            stage = (self.stage_elements("a") + self.stage_elements("b")) * self.element_bytes
            return min(WGMMA_MAX_STAGES, (H100.shared_bytes_per_block - 2 * 8 * WGMMA_MAX_STAGES) // stage)
        return DIRECT_STAGES if self.direct else 2

    @property
    def wgmma_ready(self) -> bool:
        """Whether this kernel can run on ``wgmma``: 16-bit operands copied directly in 16-byte
        vectors (a vector is one swizzle chunk), 64 deep, MN-major tiles whole 64-row columns.
        (tf32 operands, K-major, were tried on an H100: the tensor cores truncate them, and the
        capsule conv's input adjoint ran slower, 0.062 -> 0.087 ms, and less exactly.)"""
        return (
            self.storage in ("float16", "bfloat16")
            and self.direct
            and not any(self.combined(side) for side in ("a", "b"))
            and self.tiles.block_k * self.element_bytes == SWIZZLE_BYTES
            and all(self.copy_bytes(side) == VECTOR_BYTES for side in ("a", "b"))
            and all(self.tile_rows(side) % MN_ATOM_ROWS == 0 for side in ("a", "b"))
        )

    def vector(self, side: str) -> int:
        """Elements of operand ``side`` one load moves (along the rows where the operand is loaded
        row-fastest, else along the depth)."""
        return self.a_vector if side == "a" else self.b_vector

    def load_coords(self, side: str) -> tuple[sympy.Expr, sympy.Expr, int]:
        """``(row, col, count)``: the tile row and column (depth) that thread ``TID`` loads as
        element ``VEC`` of its ``ELEMENT``-th vector of operand ``side`` (``a``: ``block_m`` rows,
        ``b``: ``block_n`` rows), ``count`` vectors a thread (of ``vector(side)`` elements)."""
        rows, depth, width = self.tile_rows(side), self.tiles.block_k, self.vector(side)
        slot = TID + ELEMENT * self.copy_threads
        along_rows = self.rows_fastest(side)
        if along_rows and not self.lanes_across(side):
            row, col = (slot % (rows // width)) * width + VEC, slot // (rows // width)
        elif along_rows:
            row, col = (slot // depth) * width + VEC, slot % depth
        elif not self.lanes_across(side):
            row, col = slot // (depth // width), (slot % (depth // width)) * width + VEC
        else:
            row, col = slot % rows, (slot // rows) * width + VEC
        return row, col, rows * depth // width // self.copy_threads


def ldmatrix_a_address(layout: str = "rows", unit: int = 8) -> tuple[sympy.Expr, sympy.Expr]:
    """Row (m) and column (k) in a 16 x 2``unit`` A fragment whose address lane ``LANE`` hands
    ``ldmatrix.x4``, whose matrices are (m 0-7, k 0-u), (m 8-15, k 0-u), (m 0-7, k u-2u),
    (m 8-15, k u-2u), ``unit`` (u) elements a matrix line of 16 bytes (8 16-bit elements; 4 for
    tf32, whose 32-bit elements ``ldmatrix`` moves as pairs of 16-bit halves): in the ``rows``
    layout lanes 0-15 give the rows of the first columns and lanes 16-31 those of the
    others; in the ``depth`` layout (``.trans``, 16-bit only) each lane gives one depth line
    of its matrix (eight m a line)."""
    if layout == "rows":
        return LANE % 16, (LANE // 16) * unit
    return 8 * ((LANE // 8) % 2), LANE % 8 + 8 * (LANE // 16)


def ldmatrix_b_address(layout: str = "rows", unit: int = 8) -> tuple[sympy.Expr, sympy.Expr]:
    """Row (n) and column (k) in a 16 (n) x 2``unit`` (k) tile of two B fragments whose address
    lane ``LANE`` hands ``ldmatrix.x4``, whose matrices are (n 0-7, k 0-u), (n 0-7, k u-2u),
    (n 8-15, k 0-u), (n 8-15, k u-2u) (``unit`` as for A); in the ``depth`` layout
    (``.trans``, 16-bit only) each lane gives one depth line of its matrix."""
    if layout == "rows":
        return LANE % 8 + (LANE // 16) * 8, ((LANE // 8) % 2) * unit
    return 8 * (LANE // 16), LANE % 8 + 8 * ((LANE // 8) % 2)


def accumulator_coords() -> tuple[sympy.Expr, sympy.Expr]:
    """Row and column (in a 16 x 8 accumulator fragment) of register ``REG`` (0-3) of lane ``LANE``."""
    return LANE // 4 + 8 * (REG // 2), 2 * (LANE % 4) + REG % 2


def tf32_a_coords() -> tuple[sympy.Expr, sympy.Expr]:
    """Row and column (in a 16 x 8 tf32 A fragment) of register ``REG`` (0-3) of lane ``LANE``."""
    return LANE // 4 + 8 * (REG % 2), LANE % 4 + 4 * (REG // 2)


def tf32_b_coords() -> tuple[sympy.Expr, sympy.Expr]:
    """Row (n) and column (k) (in an 8 x 8 tf32 B fragment held n-major) of register ``REG`` (0-1) of lane ``LANE``."""
    return LANE // 4, LANE % 4 + 4 * REG


@dataclass(frozen=True)
class SimtKernel:
    """``op`` on SIMT cores: one thread per output point (per source point for a scatter op), or,
    with ``block_reduce``, one block per output point summing (maxing, ...) its reduction in
    parallel: the threads take turns over the flattened reduction domain (its last axis fastest,
    so a warp reads along memory), then combine through warp shuffles and shared memory."""

    name: str
    op: Op
    threads: int = 256
    block_reduce: bool = False

    @property
    def points(self) -> int:
        return math.prod(self.op.extent[v] for v in self.op.indices)

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.block_reduce:
            return (max(1, min(self.points, 1 << 16)), 1, 1)
        return (max(1, min(-(-self.points // self.threads), 1 << 16)), 1, 1)


#: a SIMT op reduces with a block per output point when its sum is at least this long ...
BLOCK_REDUCE_TERMS = 512
#: ... and it has at most this many output points (a thread each would leave the GPU idle)
BLOCK_REDUCE_POINTS = 1 << 16


def reduction_parts(op: Op):
    """``(reduce, epilogue)`` where ``op`` is one top-level reduction under an element-wise
    epilogue (``split_epilogue``), else None."""
    from neoflow.codegen.lattice import split_epilogue

    if op.scatter is not None:
        return None
    return split_epilogue(op.body, op)


def simt_kernel(name: str, op: Op) -> SimtKernel:
    """The SIMT kernel of ``op``: a block per output point where its one reduction is long
    (``BLOCK_REDUCE_TERMS`` terms, or as many reads a point over at least a warp's worth of terms
    that each sum more) and its points few (``BLOCK_REDUCE_POINTS``), else a thread per point.  (A
    mean loss over 64 rows of 10 classes, one point whose 64 terms each sum 10 more, took 28 us as
    one thread on an H100.)"""
    parts = reduction_parts(op)
    if parts is not None and not strided_axes(parts[0], op.extent):
        terms = math.prod(op.extent[a] for a in parts[0].axes)
        points = math.prod(op.extent[v] for v in op.indices)
        long = terms >= BLOCK_REDUCE_TERMS
        if not long and terms >= 32 and any(isinstance(node, Reduce) for node in parts[0].body.walk()):
            long = sum(op_work(op).reads.values()) / points >= BLOCK_REDUCE_TERMS
        if long and points <= BLOCK_REDUCE_POINTS:
            return SimtKernel(name, op, block_reduce=True)
    return SimtKernel(name, op)


Kernel = MmaKernel | SimtKernel


@dataclass(frozen=True)
class OpPlan:
    """How one graph op runs: its kernels in order; ``zero_first`` when the output must be
    zeroed before them (a scatter op, or pieces that leave some elements unwritten).  A kernel
    whose depth is split adds its partial sums into a zeroed float32 workspace the size of the
    output (``workspace``), and its finishing kernel applies the epilogue from there."""

    op: Op
    kernels: tuple[Kernel, ...]
    zero_first: bool

    @property
    def workspace(self) -> bool:
        return any(isinstance(k, MmaKernel) and k.splits > 1 for k in self.kernels)


def _rows_fastest(view: GemmView, side: str) -> bool:
    """Whether operand ``side``'s reads run along memory with its row index (its
    innermost row variable moves the read by one element) rather than its depth."""
    expr = view.a if side == "a" else view.b
    rows = view.m if side == "a" else view.n
    reads = expr.reads()
    if not reads or not rows:
        return False
    shapes = {t.name: t.shape for t in view.op.inputs}
    read = reads[0]
    offset = read_offset(read.indices, shapes[read.tensor], view.op.extent)
    inner_row = index.var(rows[-1][0])
    inner_depth = index.var(view.k[-1][0])
    unit = {name for name in (inner_row, inner_depth) if offset.is_polynomial(name) and offset.coeff(name) == 1}
    return inner_row in unit and inner_depth not in unit


#: depth splits a plan may choose; each split keeps at least ``MIN_SPLIT_TILES`` depth tiles (a long
#: depth on one or two blocks of outputs wants hundreds: capsule28's first-layer weight gradient, 1352
#: depth tiles on two blocks, ran in 46.9 us with 256 splits against 73.6 us with 128 on an H100)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_SPLIT_TILES = 4


def unit_run_steps(offset: sympy.Expr, inner: str, variables: list[str]) -> list[int] | None:
    """Where ``offset`` moves by one element along variable ``inner``: how far it moves along each of
    ``variables`` (``inner`` itself left out), then its constant part — runs of consecutive elements
    along ``inner`` start where these allow (vector loads, paired stores); None where ``inner``
    does not step by one or another part is not an integer multiple of a variable."""
    offset = sympy.expand(offset)
    if offset.coeff(index.var(inner)) != 1:
        return None
    others = sympy.expand(offset - index.var(inner))
    symbols = [index.var(v) for v in variables if v != inner]
    parts = [others.coeff(v) for v in symbols] + [others.subs(dict.fromkeys(symbols, 0))]
    return [int(part) for part in parts] if all(part.is_Integer for part in parts) else None


def vector_width(view: GemmView, side: str, gather: Gather | None, rows_fastest: bool, tiles: Tiles) -> int:
    """Elements of operand ``side`` a thread loads at once: the most of ``VECTOR_BYTES``, 8 or 4
    bytes' worth (at least two elements; else 1) such that the operand is a table gather whose
    guard, if any, guards the read alone and stays the same along a run, runs of that many
    elements lie together in memory along the direction it is
    loaded in (the innermost row variable when ``rows_fastest``, else the innermost depth
    variable: coefficient one, its extent a multiple of the width, every other coefficient too,
    so every run starts aligned), and the tile splits into whole runs."""
    if gather is None:
        return 1
    tensors = [t for t in view.op.inputs if t.name in gather.tensors]
    if len({t.dtype for t in tensors}) > 1:
        return 1
    guarded = gather.row_vars if rows_fastest else gather.depth_vars
    axis = (view.m if side == "a" else view.n) if rows_fastest else view.k
    name, extent = axis[-1]
    if (gather.row_vars or gather.depth_vars) and (gather.guard is None or name in guarded):
        return 1  # a guard that changes along a run, or one not on the read alone
    tensor = next(t for t in view.op.inputs if t.name == gather.tensor)
    if tensor.dtype not in ("float32", "float16", "bfloat16"):
        return 1
    itemsize = dt.numpy_dtype(tensor.dtype).itemsize
    offset = gather.row_part + gather.depth_part + gather.rest
    coefficients = unit_run_steps(offset, name, [v for v, _ in (*view.m, *view.n, *view.k, *view.batch)])
    if coefficients is None:
        return 1
    rows = tiles.block_m if side == "a" else tiles.block_n
    for width in (VECTOR_BYTES // itemsize, 8 // itemsize, 4 // itemsize):
        if width < 2 or extent % width or any(c % width for c in coefficients):
            continue
        if (rows if rows_fastest else tiles.block_k) % width or (rows * tiles.block_k // width) % tiles.threads:
            continue
        return width
    return 1


@dataclass(frozen=True)
class Operands:
    """What a view's kernels share whatever their tiles: per operand its table gather and whether
    its reads run along memory with its rows (``_rows_fastest``)."""

    gathers: tuple[Gather | None, Gather | None]
    rows_fastest: tuple[bool, bool]


def operands(view: GemmView) -> Operands:
    """The ``Operands`` of ``view``."""
    return Operands(
        (gather_plan(view, "a"), gather_plan(view, "b")), (_rows_fastest(view, "a"), _rows_fastest(view, "b"))
    )


def make_kernel(name: str, view: GemmView, tiles: Tiles, precision: str, shared: Operands | None = None) -> MmaKernel:
    """The ``MmaKernel`` of ``view`` with ``tiles``: load directions, table gathers (``shared``:
    ``operands(view)``, computed here if not given), vector widths, and per gathered operand
    the order of its threads' loads that touches fewer memory sectors, then lines."""
    shared = shared or operands(view)
    gathers, rows_fastest = shared.gathers, shared.rows_fastest
    vectors = (
        vector_width(view, "a", gathers[0], rows_fastest[0], tiles),
        vector_width(view, "b", gathers[1], rows_fastest[1], tiles),
    )
    kernel = MmaKernel(name, view, tiles, precision, *rows_fastest, *gathers, 1, *vectors)
    for side in ("a", "b"):
        if kernel.gather(side) is None:
            continue
        across = dataclasses.replace(kernel, **{f"{side}_lanes_across": True})
        if copy_footprint(across, side) < copy_footprint(kernel, side):
            kernel = across
    return kernel


#: bytes of the memory sectors loads are served in, of the cache lines they lie in, and of the
#: wavefront one request of a warp's load moves (16-byte vectors: a quarter warp's)
SECTOR_BYTES, LINE_BYTES, REQUEST_BYTES = 32, 128, 128


def copy_footprint(kernel: MmaKernel, side: str) -> tuple[float, float]:
    """Memory sectors (``SECTOR_BYTES``), then cache lines (``LINE_BYTES``), one request of a load
    of operand ``side`` touches (the lanes whose vectors one ``REQUEST_BYTES`` wavefront moves:
    eight lanes of 16-byte vectors, sixteen of 8, a warp of 4), on average over the first block's
    threads and every load of its first depth tile (from the index tables: the very addresses the
    kernel reads).  Counted a warp at a time, both orders of the capsule conv's stride-2 input
    touched 16 sectors a warp; a quarter warp at a time, the order now taken touches 4 where the
    other touches 8, and it ran faster on an H100 (the stride-2 tf32 forward 59.6 -> 51.6 us, the
    input adjoint 69.6 -> 56.5 us)."""
    row_f, col_f, count = kernel.load_coords(side)
    rows_table, depth_table = kernel.side_tables[side]
    gather = kernel.gather(side)
    itemsize = dt.numpy_dtype(next(t.dtype for t in kernel.view.op.inputs if t.name == gather.tensor)).itemsize
    lanes = min(32, max(1, REQUEST_BYTES // (kernel.vector(side) * itemsize)))
    threads = np.arange(kernel.copy_threads)
    rest = int(index.evaluate(gather.rest, dict.fromkeys((v for v, _ in kernel.view.batch), 0)))
    limit = kernel.view.sizes[1] if side == "a" else kernel.view.sizes[2]
    totals = [0, 0]
    for element in range(count):
        env = {"tid": threads, "element": np.full_like(threads, element), "vec": np.zeros_like(threads)}
        rows = np.broadcast_to(np.asarray(index.evaluate(row_f, env), dtype=np.int64), threads.shape)
        cols = np.broadcast_to(np.asarray(index.evaluate(col_f, env), dtype=np.int64), threads.shape)
        live = (rows < limit) & (cols < kernel.view.sizes[3])
        offsets = rows_table[np.where(live, rows, 0), 0].astype(np.int64) + depth_table[np.where(live, cols, 0), 0]
        addresses = (offsets + rest) * itemsize
        for first in range(0, kernel.copy_threads, lanes):
            part = slice(first, first + lanes)
            for k, unit in enumerate((SECTOR_BYTES, LINE_BYTES)):
                totals[k] += len(np.unique(addresses[part][live[part]] // unit))
    requests = count * -(-kernel.copy_threads // lanes)
    return totals[0] / requests, totals[1] / requests


def allowed_tiles(kernel: MmaKernel, tuner: bool = False) -> tuple[Tiles, ...]:
    """The tiles ``kernel``'s main loop may take (``DIRECT_TILES``, and for the tuner ``TUNER_TILES``,
    only with cp.async)."""
    if not kernel.direct:
        return TILE_CHOICES
    return TILE_CHOICES + DIRECT_TILES + (TUNER_TILES if tuner else ())


def whole_copies(kernel: MmaKernel) -> bool:
    """Whether ``kernel``'s threads copy each operand tile in whole vectors, every thread as many,
    and its warps' depth slices are whole MMA steps deep."""
    tiles = kernel.tiles
    if tiles.block_k % (tiles.warps_k * kernel.mma_shape[2]) or kernel.block_threads > 1024:
        return False
    if kernel.specialized and (tiles.warps_k > 1 or not kernel.direct):
        return False  # a producer warpgroup copies by cp.async; the slices' sums would wait on it at a barrier
    copied = {side: kernel.load_coords(side)[2] * kernel.vector(side) * kernel.copy_threads for side in ("a", "b")}
    return all(copied[side] == kernel.tile_rows(side) * tiles.block_k for side in ("a", "b"))


def producer_twin(kernel: MmaKernel) -> MmaKernel | None:
    """``kernel`` warp-specialised (``MmaKernel.specialized``: a producer warpgroup copying the stages
    while the tiles' warps multiply), or None where it cannot be: not copied by cp.async, a ``wgmma``
    kernel (one already), a sliced depth.  Alone on an H200, most of capsule28's tf32 kernels ran
    faster so (their copies and products no longer take turns in each warp): the forward in 128 x 128
    tiles 45.9 -> 38.6 us, the second weight gradient 59.1 -> 51.6 us, the input gradient's pieces in
    128 x 64 tiles 45.7 -> 42.4 us."""
    if kernel.wgmma or kernel.specialized or not kernel.direct:
        return None
    twin = dataclasses.replace(kernel, specialized=True)
    return twin if whole_copies(twin) else None


def retiled(plan: OpPlan, tiles: Tiles) -> OpPlan | None:
    """``plan`` with every tensor-core kernel in ``tiles`` (the same depth splits), or None where one
    cannot take them (a ``TUNER_TILES`` layout needs cp.async copies, every layout whole copies)."""
    kernels = tuple(
        dataclasses.replace(make_kernel(k.name, k.view, tiles, k.precision), splits=k.splits)
        if isinstance(k, MmaKernel)
        else k
        for k in plan.kernels
    )
    mma = [k for k in kernels if isinstance(k, MmaKernel)]
    if not all(whole_copies(k) and tiles in allowed_tiles(k, tuner=True) for k in mma):
        return None
    return OpPlan(plan.op, kernels, plan.zero_first)


def _candidate_kernels(name: str, view: GemmView, precision: str, arch: str, tuner: bool = False):
    """Every kernel of ``view`` a plan may choose among: ``mma.sync`` with each allowed tile (``tuner``:
    ``TUNER_TILES`` too), and on ``WGMMA_ARCHS`` ``wgmma`` with ``WGMMA_TILES`` where the operands allow it."""
    shared = operands(view)
    for tiles in TILE_CHOICES + DIRECT_TILES + (TUNER_TILES if tuner else ()):
        kernel = make_kernel(name, view, tiles, precision, shared)
        if tiles in allowed_tiles(kernel, tuner) and whole_copies(kernel):
            yield kernel
        twin = producer_twin(kernel) if tuner else None
        if twin is not None:
            yield twin
    if arch not in WGMMA_ARCHS:
        return
    for tiles in WGMMA_TILES:
        kernel = dataclasses.replace(make_kernel(name, view, tiles, precision, shared), wgmma=True)
        if kernel.wgmma_ready:
            yield kernel


def candidates(
    name: str, view: GemmView, precision: str, arch: str = DEFAULT_ARCH, tuner: bool = False
) -> list[MmaKernel]:
    """Every kernel a plan of ``view`` may take: each of ``_candidate_kernels`` within the shared
    memory a block may have, with each depth split (``SPLITS``) its depth tiles allow (``tuner``: with
    the warp layouts only the tuner tries)."""
    found = []
    for kernel in _candidate_kernels(name, view, precision, arch, tuner):
        if kernel.shared_bytes > H100.shared_bytes_per_block:
            continue
        for splits in SPLITS:
            if splits > 1 and kernel.depth_tiles < splits * MIN_SPLIT_TILES:
                break
            found.append(dataclasses.replace(kernel, splits=splits))
    return found


def choose_kernel(
    name: str, view: GemmView, precision: str, predict, arch: str = DEFAULT_ARCH, entry: dict | None = None
) -> MmaKernel:
    """The kernel of ``view`` among its ``candidates``: the one a measured ``entry`` (``tuning``)
    records where it is one of them, else the one the timing model ``predict(kernel) -> seconds``
    likes best."""
    if entry is not None:
        for kernel in candidates(name, view, precision, arch, tuner=True):
            if tuning.matches(kernel, entry):
                return kernel
    found = candidates(name, view, precision, arch)
    return min(found, key=lambda k: (predict(k), k.splits, -k.tiles.block_m * k.tiles.block_n))


def tensor_core_plan(
    op: Op,
    name: str,
    precision: str = DEFAULT_PRECISION,
    arch: str = DEFAULT_ARCH,
    use_table: bool = True,
    beside: bool = False,
) -> OpPlan | None:
    """``op``'s contraction pieces on the tensor cores of ``arch`` (kernels named ``name``,
    ``name_1``, ...), each with the instruction, tiles and splits measured on the GPU where the
    tuning table has them (``use_table``), else those the timing model likes best (``beside``: for
    an op running beside other work, the least of the GPU's time, ``predict_kernel``'s ``beside``,
    or what the table measured of it there, ``tuner.tune_beside``: not alone); None where the
    precision has no MMA, an operand is not floating or the op is no contraction the mapper places."""
    check_precision(precision)
    if PRECISIONS[precision] is None or any(t.dtype not in ("float32", "float16", "bfloat16") for t in op.inputs):
        return None
    views = gemm_views(op, TENSOR_CORE)
    if views is None:
        return None
    kernels = tuple(
        choose_kernel(
            name if k == 0 else f"{name}_{k}",
            view,
            precision,
            partial(predict_kernel, beside=beside),
            arch,
            tuning.measured(op, k, precision, arch, beside) if use_table else None,
        )
        for k, view in enumerate(views)
    )
    return OpPlan(op, kernels, not covers_output(op, views))


def plan_op(
    op: Op,
    name: str,
    precision: str = DEFAULT_PRECISION,
    arch: str = DEFAULT_ARCH,
    measured: bool = True,
    beside: bool = False,
) -> OpPlan:
    """The kernels of ``op`` (named ``name``, ``name_1``, ...) for a GPU of ``arch``: its ``tensor_core_plan`` where
    it has one, else one SIMT kernel; a long sum with few outputs runs a block per output
    point instead where the timing model expects that faster, and always where an operand
    would be decoded variable by variable at every element (no index tables: capsule28's k1
    update took 0.48 ms on the tensor cores, 0.17 ms a block per output, on an H100).  ``measured``:
    with the kernels the tuning table records (False: the timing model's own choices, which the fusion
    cost model plans with, so that a table never changes the fusion plan whose ops it was measured on).
    ``beside``: the op runs beside other work of its graph (``tensor_core_plan``)."""
    return _plan_op(op, name, precision, arch, table_digest(tuning.table_path(arch)) if measured else "off", beside)


@lru_cache(maxsize=512)
def _plan_op(op: Op, name: str, precision: str, arch: str, table: str, beside: bool = False) -> OpPlan:
    """``plan_op`` for the tuning table whose digest is ``table`` (a new table plans afresh; ``off``:
    none)."""
    plan = tensor_core_plan(op, name, precision, arch, use_table=table != "off", beside=beside)
    simt = simt_kernel(name, op)
    if plan is None:
        return OpPlan(op, (simt,), op.scatter is not None)
    untabled = any(k.a_gather is None or k.b_gather is None for k in plan.kernels)
    if simt.block_reduce and (untabled or predict_kernel(simt) < sum(predict_kernel(k) for k in plan.kernels)):
        return OpPlan(op, (simt,), False)
    return plan
