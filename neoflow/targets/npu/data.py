"""What the NPU's instructions compute: the specs the compiler attaches and the functional simulator runs.

An instruction's ``data`` says which elements it moves or combines, in the
terms of the op it was compiled from: the GM elements a load brings on chip
(``Footprint``), the operand tile an ``mte1.img2col`` builds from an L1 patch
(``OperandTile``), the output tile a ``fixpipe.store`` writes (``OutputTile``),
the output tile whose epilogue the vector unit applies on chip (``EpilogueTile``),
the points a vector instruction computes (``VectorChunk``).  The compiler derives
costs from the same specs (bytes, runs of consecutive addresses), so what is
timed is what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from neoflow.codegen.gather import Gather
from neoflow.codegen.implicit_gemm import GemmView
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import Expr, Read, Reduce
from neoflow.ir.op import Op, Tensor

#: bytes a GM access is served in: a run of consecutive elements moves in whole sectors
GM_SECTOR_BYTES = 32


def align(value: int, unit: int) -> int:
    """``value`` rounded up to a multiple of ``unit``."""
    return -(-value // unit) * unit


def reads_in(node: Expr, inside: bool = False) -> list[tuple[Read, bool]]:
    """Every read of ``node`` with whether it lies inside a reduction."""
    found = [(node, inside)] if isinstance(node, Read) else []
    for child in node.children():
        found += reads_in(child, inside or isinstance(node, Reduce))
    return found


def read_footprint(read: Read, tensor: Tensor, env: dict, live: np.ndarray | None = None) -> Footprint:
    """The elements of ``tensor`` that ``read`` touches at the points of ``env`` (where ``live``):
    its flat offsets, inside the tensor (a guarded read's out-of-bounds points read nothing)."""
    flat = np.asarray(index.evaluate(index.flat_offset(read.indices, tensor.shape), env), dtype=np.int64)
    shape = np.broadcast_shapes(*(np.shape(v) for v in env.values()))
    flat = np.broadcast_to(flat, shape)
    if live is not None:
        flat = flat[np.broadcast_to(live, shape)]
    flat = flat[(flat >= 0) & (flat < tensor.size)]
    return Footprint(tensor.name, np.unique(flat), dt.numpy_dtype(tensor.dtype).itemsize)


@dataclass(frozen=True, eq=False)
class Footprint:
    """The elements ``offsets`` (flat, sorted, unique) of GM tensor ``tensor`` (``itemsize``
    bytes each) that one load brings into a buffer, in the order they lie there."""

    tensor: str
    offsets: np.ndarray
    itemsize: int

    @property
    def bytes(self) -> int:
        return int(self.offsets.size) * self.itemsize

    @cached_property
    def runs(self) -> int:
        """Runs of consecutive addresses (each a separate burst train)."""
        if self.offsets.size == 0:
            return 0
        return int(np.count_nonzero(np.diff(self.offsets) != 1)) + 1

    @cached_property
    def moved_bytes(self) -> int:
        """Bytes the mover moves: every run rounded up to whole ``GM_SECTOR_BYTES`` sectors."""
        if self.offsets.size == 0:
            return 0
        breaks = np.flatnonzero(np.diff(self.offsets) != 1)
        starts = np.concatenate(([0], breaks + 1))
        ends = np.concatenate((breaks + 1, [self.offsets.size]))
        first = self.offsets[starts] * self.itemsize
        last = self.offsets[ends - 1] * self.itemsize + self.itemsize
        sectors = (last + GM_SECTOR_BYTES - 1) // GM_SECTOR_BYTES - first // GM_SECTOR_BYTES
        return int(sectors.sum()) * GM_SECTOR_BYTES

    @property
    def span(self) -> tuple[int, int]:
        """``(first byte, bytes)`` of the GM range the elements lie in."""
        if self.offsets.size == 0:
            return 0, 0
        low = int(self.offsets[0]) * self.itemsize
        return low, int(self.offsets[-1]) * self.itemsize + self.itemsize - low


@dataclass(frozen=True, eq=False)
class OperandTile:
    """Operand ``side`` of ``view`` (``a``: rows m, ``b``: rows n) over rows ``rows`` and depths
    ``depth`` at batch point ``batch`` (flat), gathered through ``gather`` from the L1 patch
    (``Footprint``) an earlier ``mte2`` load brought in, rounded to the cube's input type."""

    view: GemmView
    side: str
    gather: Gather
    rows: range
    depth: range
    batch: int


@dataclass(frozen=True, eq=False)
class OutputTile:
    """Rows ``rows`` and columns ``cols`` of ``view``'s product at batch point ``batch``: where
    ``fixpipe.store`` puts them (``view.out_offset``) after the epilogue (``epilogue``: applied
    on the way; False: the raw fp32 sums go to the workspace ``workspace``, added atomically to
    what is there with ``accumulate``: a depth split's partial sums).  A store into UB drains
    rows ``rows`` of the L0C tile holding rows ``tile_rows``."""

    view: GemmView
    rows: range
    cols: range
    batch: int
    epilogue: bool
    workspace: str | None = None
    accumulate: bool = False
    tile_rows: range | None = None


@dataclass(frozen=True, eq=False)
class EpilogueTile:
    """Rows ``rows`` and columns ``cols`` of ``view``'s product at batch point ``batch``, whose
    epilogue the vector unit applies in UB: to the fp32 sums FIXPIPE drained there and the
    elements of other tensors MTE2 brought beside them; MTE3 stores the result."""

    view: GemmView
    rows: range
    cols: range
    batch: int


@dataclass(frozen=True, eq=False)
class VectorChunk:
    """Output points ``points`` (flat) of ``op`` on the vector unit; ``terms`` the slice of its
    reduction's flattened domain this step adds (None: the whole of it, or no reduction);
    ``first``/``last``: whether the step starts and finishes the points' sums; ``accumulator``:
    a GM workspace holding each point's reduction value (an epilogue after the cube)."""

    op: Op
    points: range
    terms: range | None
    first: bool
    last: bool
    accumulator: str | None = None
