"""Contractions on the cube: a ``GemmView`` (the AMOS mapper's matrix view of an op) as an NPU program.

Each core takes output tiles of ``m x n`` round-robin.  For a tile it walks the
depth in L1 steps of ``k1``: MTE2 brings the GM *patch* each operand's tile reads
(its unique elements, through the op's own index tables: a convolution's input
window, not an im2col copy) into one half of L1; MTE1 then builds, for every L0
step of ``k0``, the operand tiles in 16x16 fractals (``mte1.img2col``: the gather
and the fp16 rounding on the way) in one half of L0A / L0B; the cube multiplies
them into one half of L0C (fp32); FIXPIPE drains a finished tile to GM,
converting and applying the epilogue on the way (an element-wise tail and
per-row or per-column tensors, as a bias).  An epilogue reading other tensors
(a ReLU's mask, a residual) runs on chip where the core also holds a vector unit
(``npu``): FIXPIPE drains the sums into one half of UB, MTE2 brings the elements
the epilogue reads beside them, the vector unit applies it and MTE3 stores the
result — the sums never visit GM.  Where it does not (``npu-split``), or where
cores split the depth and their partial sums must meet first, FIXPIPE leaves fp32
sums in a GM workspace for a vector program.  Every hand-over
between pipes is a ``set_flag``/``wait_flag`` pair, every buffer is ping-ponged,
so loads of the next step overlap the cube's work on this one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from neoflow.codegen.gather import Gather, gather_plan, gather_tables, unravel
from neoflow.codegen.implicit_gemm import GemmView
from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import Read
from neoflow.ir.interpreter import evaluate_at
from neoflow.targets.npu.data import (
    EpilogueTile,
    Footprint,
    OperandTile,
    OutputTile,
    align,
    read_footprint,
    reads_in,
)
from neoflow.targets.npu.isa import Program, Region, copy, mmad, set_flag, vector, wait_flag
from neoflow.targets.npu.loads import FirstTouch, gm_load, gm_region
from neoflow.targets.npu.machine import GM, Machine
from neoflow.targets.npu.vector import operations

#: depth sizes a tile may take (multiples of the cube's 16) ...
SIZES = (16, 32, 64, 128, 256)
#: ... and its rows and columns: any multiple of 16 to 256, so an op's tiles can split evenly over the
#: cores (a 3x3 conv's 25,088 output rows are 224 tiles of 112, seven a core of 32; tiles of 128 or 256
#: left two cores a quarter more work than the other thirty)
ROW_SIZES = tuple(range(16, 257, 16))
#: ... and to 512 for a lone view's tiles that take all of L0C (``tile_candidates``)
LONE_ROW_SIZES = tuple(range(16, 513, 16))
#: L1 steps a tile's depth step may span (in L0 steps)
L1_STEPS = (1, 2, 4, 8)
#: bytes of the cube's operand and accumulator elements
OPERAND_BYTES, ACCUMULATOR_BYTES = 2, 4


@dataclass(frozen=True)
class CubeTiles:
    """An output tile of ``m x n`` (L0C), the depth in L0 steps of ``k0`` (L0A/L0B) and L1 steps
    of ``k1`` (a multiple of ``k0``), cut into ``splits`` ranges of whole L1 steps that cores sum
    apart (their partial sums added atomically into an fp32 workspace)."""

    m: int
    n: int
    k0: int
    k1: int
    splits: int = 1

    def depth_ranges(self, k_size: int) -> list[range]:
        """The depth ranges of the splits: whole L1 steps each, as even as whole steps allow
        (their counts differ by one at most), none empty."""
        steps = math.ceil(k_size / self.k1)
        parts = min(self.splits, steps)
        bounds = [part * steps // parts for part in range(parts + 1)]
        return [range(a * self.k1, min(b * self.k1, k_size)) for a, b in itertools.pairwise(bounds)]


#: depth splits a contraction may take (when it has fewer output tiles than cores)
SPLITS = (1, 2, 4, 8, 16, 32)


def _pad16(value: int) -> int:
    return align(value, 16)


def cube_operands(view: GemmView) -> tuple[Gather, Gather] | None:
    """Each operand's table gather, where both are plain copies of one tensor's elements (the
    read itself, or under a padding guard): what MTE2 and MTE1 can move.  None otherwise."""
    found = []
    for side in ("a", "b"):
        gather = gather_plan(view, side)
        if gather is None or not gather.plain or len(gather.tensors) != 1:
            return None
        found.append(gather)
    return found[0], found[1]


def _epilogue_reads(view: GemmView) -> list[Read]:
    """The reads of ``view``'s epilogue outside its reduction."""
    return [] if view.epilogue is None else [read for read, inside in reads_in(view.epilogue) if not inside]


def fixpipe_epilogue(view: GemmView) -> bool:
    """Whether FIXPIPE applies ``view``'s epilogue on the way out: it reads no tensor, or only
    tensors indexed by the row variables alone or the column variables alone (a bias)."""
    rows = {v for v, _ in view.m} | {v for v, _ in view.batch}
    cols = {v for v, _ in view.n} | {v for v, _ in view.batch}
    for read in _epilogue_reads(view):
        used = {s.name for i in read.indices for s in i.free_symbols}
        if not (used <= rows or used <= cols):
            return False
    return True


def vector_epilogue(machine: Machine) -> bool:
    """Whether an epilogue FIXPIPE cannot apply runs on the vector unit of the core that computed
    the tile (FIXPIPE drains L0C into UB): a machine whose cores hold both units."""
    return machine.layout == "coupled" and machine.has_path("L0C", "UB")


def epilogue_point_bytes(view: GemmView, output_itemsize: int) -> int:
    """UB bytes an output point of an on-chip epilogue takes at most: its fp32 sum, the elements
    its epilogue reads and its result."""
    tensors = {t.name: t for t in view.op.inputs}
    reads = sum(dt.numpy_dtype(tensors[r.tensor].dtype).itemsize for r in _epilogue_reads(view))
    return ACCUMULATOR_BYTES + reads + output_itemsize


def _tensor(view: GemmView, name: str):
    return next(t for t in view.op.inputs if t.name == name)


def _bound_bytes(view: GemmView, gather: Gather, rows: int, depth: int) -> int:
    tensor = _tensor(view, gather.tensor)
    return min(rows * depth, tensor.size) * dt.numpy_dtype(tensor.dtype).itemsize


def tile_candidates(
    view: GemmView,
    machine: Machine,
    gathers: tuple[Gather, Gather],
    cores: int,
    ub_point_bytes: int = 0,
    lone: bool = False,
) -> list[CubeTiles]:
    """The tiles that fit the buffers (each half of a ping-pong pair), best first by a pipelined
    estimate (the slowest of cube, MTE1 and MTE2 per step, tiles spread over ``cores``);
    ``ub_point_bytes``: an on-chip epilogue's UB bytes per output point (16 rows of a tile and
    their epilogue must fit a half of UB: FIXPIPE drains a tile in chunks of rows).  ``lone``: the
    view is its program's only one, so a tiling that gives every core one tile at most may take all
    of L0C for it (no second tile to drain behind: larger tiles, fewer re-reads of the operands)."""
    batch, m_size, n_size, k_size = view.sizes
    l1 = machine.buffer("L1").capacity
    l0a, l0b, l0c = (machine.buffer(name).capacity for name in ("L0A", "L0B", "L0C"))
    ub_half = machine.buffer("UB").capacity // 2 if ub_point_bytes else None
    mte2 = machine.mover(GM, "L1")
    mte1 = machine.mover("L1", "L0A")
    rate = min(mte2.bytes_per_cycle, machine.memory.l2_bytes_per_cycle / max(1, cores))
    found: list[tuple[float, int, CubeTiles]] = []
    sizes = LONE_ROW_SIZES if lone else ROW_SIZES
    for m in (s for s in sizes if s <= _pad16(m_size)):
        for n in (s for s in sizes if s <= _pad16(n_size)):
            whole = _over_half_l0c(m, n, l0c)  # one tile a core only
            if (
                (whole and not lone)
                or (not whole and max(m, n) > ROW_SIZES[-1])  # sizes past 256 only for whole tiles
                or m * n * ACCUMULATOR_BYTES > l0c
                or (ub_half is not None and 16 * n * ub_point_bytes + 1024 > ub_half)
            ):
                continue
            tiles = batch * math.ceil(m_size / m) * math.ceil(n_size / n)
            for k0 in (s for s in SIZES if s <= _pad16(k_size)):
                if 2 * m * k0 * OPERAND_BYTES > l0a or 2 * n * k0 * OPERAND_BYTES > l0b:
                    continue
                for steps in L1_STEPS:
                    k1 = k0 * steps
                    if k1 > _pad16(k_size) and steps > 1:
                        break
                    patch = _bound_bytes(view, gathers[0], m, k1) + _bound_bytes(view, gathers[1], n, k1)
                    if 2 * (patch + 64) > l1:
                        continue
                    for splits in SPLITS:
                        if splits > 1 and (tiles * splits > 2 * cores or splits > math.ceil(k_size / k1)):
                            break
                        if whole and tiles * splits > cores:
                            continue
                        l0_steps = math.ceil(k_size / k0 / splits)
                        l1_steps = math.ceil(k_size / k1 / splits)
                        cube = l0_steps * (m // 16) * (n // 16) * (k0 // 16)
                        moves1 = l0_steps * (m + n) * k0 * OPERAND_BYTES / mte1.bytes_per_cycle
                        moves2 = l1_steps * patch / rate
                        # two L1 halves: a half is busy from its load's issue to the end of its img2cols,
                        # so an L1 step takes at least half of a load, its latency and the step's MTE1 work
                        ring = l1_steps * (patch / rate + mte2.latency) / 2 + moves1 / 2
                        drain = m * n * ACCUMULATOR_BYTES / machine.mover("L0C", GM).bytes_per_cycle
                        per_core = math.ceil(tiles * splits / cores)
                        cycles = per_core * (max(cube, moves1, moves2, ring) + drain / 4) + mte2.latency + drain
                        if splits > 1:  # zero the workspace, then the epilogue pass over it
                            cycles += 3 * m_size * n_size * batch * ACCUMULATOR_BYTES / (rate * cores) + 1000
                        found.append((cycles, -m * n * k1, CubeTiles(m, n, k0, k1, splits)))
    if not found:
        raise CompileError(
            f"npu: op '{view.op.name}': no cube tile fits the buffers of machine '{machine.name}' "
            "(L1, L0A, L0B and L0C must each hold two halves of at least a 16 x 16 tile)",
            op=view.op.name,
        )
    return [tiles for *_, tiles in sorted(found, key=lambda f: f[:2])]


def whole_l0c(tiles: CubeTiles, machine: Machine) -> bool:
    """Whether ``tiles``' output tile takes more than half of L0C (so all of it: ``tile_candidates``)."""
    return _over_half_l0c(tiles.m, tiles.n, machine.buffer("L0C").capacity)


def _over_half_l0c(m: int, n: int, l0c: int) -> bool:
    return 2 * m * n * ACCUMULATOR_BYTES > l0c


def choose_tiles(view: GemmView, machine: Machine, gathers: tuple[Gather, Gather], cores: int) -> CubeTiles:
    """The tiles the estimate likes best (``tile_candidates``)."""
    return tile_candidates(view, machine, gathers, cores)[0]


@lru_cache(maxsize=64)
def _tables(view: GemmView, side: str, gather: Gather):
    return gather_tables(view, side, gather)


def operand_offsets(tile: OperandTile, batch_env: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, live)``: per element ``[row, depth]`` of the tile the flat offset it reads
    and whether its guard holds (else it is zero and reads nothing)."""
    rows_table, depth_table = _tables(tile.view, tile.side, tile.gather)
    rows = rows_table[tile.rows.start : tile.rows.stop]
    depth = depth_table[tile.depth.start : tile.depth.stop]
    rest = int(np.asarray(index.evaluate(tile.gather.rest, batch_env)))
    offsets = rows[:, :1].astype(np.int64) + depth[None, :, 0] + rest
    live = np.ones(offsets.shape, bool)
    guard = tile.gather.guard
    if guard is not None:
        env = {v: rows[:, 1 + i][:, None] for i, v in enumerate(tile.gather.row_vars)}
        env.update({v: depth[:, 1 + i][None, :] for i, v in enumerate(tile.gather.depth_vars)})
        env.update(batch_env)
        live = np.broadcast_to(evaluate_at(guard, env, {}, tile.view.op.name), offsets.shape).astype(bool)
    return offsets, live


def patch_offsets(tile: OperandTile, batch_env: dict) -> np.ndarray:
    """The sorted, distinct GM offsets ``tile`` reads (its L1 patch).  Where its rows' offsets lie
    further apart than its depths span, or the other way round (a matrix's rows or columns), and
    no guard drops elements, they are already distinct and come out sorted without a sort."""
    offsets, live = operand_offsets(tile, batch_env)
    if live.all() and offsets.size:
        rows, depth = offsets[:, 0] - offsets[0, 0], offsets[0] - offsets[0, 0]
        for outer, inner in ((np.sort(rows), np.sort(depth)), (np.sort(depth), np.sort(rows))):
            if (np.diff(inner) > 0).all() and (np.diff(outer) > inner[-1] - inner[0]).all():
                return (offsets[0, 0] + outer[:, None] + inner[None, :]).reshape(-1)
    return np.unique(offsets[live])


def batch_env(view: GemmView, batch: int) -> dict:
    """The batch variables' values at flat batch point ``batch``."""
    return {k: int(v) for k, v in unravel(np.asarray(batch), view.batch).items()} if view.batch else {}


def output_offsets(view: GemmView, rows: range, cols: range, batch: int) -> tuple[dict, np.ndarray]:
    """The environment of an output tile's points (``[row, col]``) and their flat output offsets."""
    r, c = np.meshgrid(np.arange(rows.start, rows.stop), np.arange(cols.start, cols.stop), indexing="ij")
    env = {**unravel(r, view.m), **unravel(c, view.n), **batch_env(view, batch)}
    offsets = np.broadcast_to(np.asarray(index.evaluate(view.out_offset, env), dtype=np.int64), r.shape)
    return env, offsets


def _epilogue_footprints(view: GemmView, env: dict) -> list[Footprint]:
    tensors = {t.name: t for t in view.op.inputs}
    return [read_footprint(read, tensors[read.tensor], env) for read in _epilogue_reads(view)]


class _Flags:
    """The flag traffic of one core: ``signal`` / ``wait`` by (source, destination, slot)."""

    def __init__(self, program: Program, core: int) -> None:
        self.program, self.core = program, core

    def signal(self, source: str, destination: str, slot: int) -> None:
        self.program.add(set_flag(self.core, source, destination, slot))

    def wait(self, source: str, destination: str, slot: int) -> None:
        self.program.add(wait_flag(self.core, source, destination, slot))


def tile_order(view: GemmView, tiles: CubeTiles) -> list[tuple[int, int, int, range]]:
    """``view``'s output tiles ``(batch, first row, first column, depth range)`` in the order the
    cores take them, round-robin."""
    batch, m_size, n_size, k_size = view.sizes
    return [
        (z, mi, ni, depth)
        for z in range(batch)
        for mi in range(0, m_size, tiles.m)
        for ni in range(0, n_size, tiles.n)
        for depth in tiles.depth_ranges(k_size)
    ]


#: a view's product as ``emit_views`` takes it: the view, its operands' gathers, its tiles
Member = tuple[GemmView, tuple[Gather, Gather], CubeTiles]


def siblings(members: Sequence[Member], output_itemsize: int, machine: Machine) -> bool:
    """Whether views with on-chip epilogues (lattice pieces) gain by sharing their epilogue loads:
    at most two (L0C's two halves), of one shape and one undivided tiling of rows and columns, whose
    first tiles' epilogue reads, loaded together, move fewer bytes than loaded apart (pieces a
    column apart read elements in the same GM sectors: each alone moves whole sectors for half
    their elements), and whose chunks of 16 rows fit a UB half together."""
    if len(members) != 2 or not _epilogue_reads(members[0][0]):
        return False
    (first, _, one), (second, _, other) = members
    if first.sizes[:3] != second.sizes[:3] or (one.m, one.n, one.splits, other.splits) != (other.m, other.n, 1, 1):
        return False
    _, m_size, n_size, _ = first.sizes
    rows, cols = range(min(one.m, m_size)), range(min(one.n, n_size))
    apart = together = 0
    for read in range(len(_epilogue_reads(first))):
        prints = [_epilogue_footprints(view, output_offsets(view, rows, cols, 0)[0])[read] for view in (first, second)]
        apart += sum(f.moved_bytes for f in prints)
        together += _union(prints).moved_bytes
    if together >= apart:
        return False
    return _chunk_rows(first, len(cols), output_itemsize, machine, 2) >= 16  # both tiles' chunks fit a UB half


def _union(footprints: Sequence[Footprint]) -> Footprint:
    """The elements of ``footprints`` (of one tensor) together: one load's footprint."""
    first = footprints[0]
    if len(footprints) == 1:
        return first
    offsets = np.unique(np.concatenate([f.offsets for f in footprints]))
    return Footprint(first.tensor, offsets, first.itemsize)


def emit_views(
    program: Program,
    members: Sequence[Member],
    cores: range,
    output: str,
    output_itemsize: int,
    workspace: str | None,
    steps: dict[int, list],
    touch: FirstTouch,
    busiest_only: bool = False,
    on_chip: bool = False,
    only: Mapping[int, Sequence[int]] | None = None,
) -> None:
    """Append the instructions of the products of ``members`` (one view, or two ``siblings``) to
    ``program``: their tiles over ``cores``, results to GM tensor ``output`` (or, with ``workspace``,
    raw sums to that fp32 tensor; with ``on_chip``, through UB and the vector unit applying the
    epilogue, ``vector_epilogue``).  Siblings' tiles at one position in ``tile_order`` are computed
    one after the other on one core, each into its half of L0C, and their epilogues then applied
    chunk by chunk with one load of the elements they read (on chip, no workspace).  ``steps`` counts
    per core its L1 steps, L0 steps, tiles and on-chip epilogue chunks so far in the program, and
    holds the last result stored from each UB half (the ping-pong halves and their flags carry on
    from one view to the next); ``touch`` which input elements the program has read (``loads``);
    ``busiest_only``: the first core's share alone (the most work items: a trial of the tiles);
    ``only``: per position in ``cores``, the tiles (positions in ``tile_order``) that core takes
    instead of its round-robin share, a core left out taking none (lattice pieces side by side:
    ``compile.pieces_side_by_side``)."""
    machine = program.machine
    lists = [tile_order(view, tiles) for view, _, tiles in members]
    # every buffer in two fixed halves (whatever the tiles, so halves stay apart from one view to the next)
    slot_l1 = machine.buffer("L1").capacity // 2
    a_bound = max(align(_bound_bytes(view, gathers[0], tiles.m, tiles.k1), 32) for view, gathers, tiles in members)
    for position, core in enumerate(cores[:1] if busiest_only else cores):
        picks = range(position, len(lists[0]), len(cores)) if only is None else only.get(position, ())
        if not picks:
            continue
        flags = _Flags(program, core)
        state = steps.setdefault(core, [0, 0, 0, 0, {}])  # L1 steps, L0 steps, tiles, chunks, stored
        rooms = [[a_bound, slot_l1], [slot_l1 + a_bound, 2 * slot_l1]]  # [next free byte, end] in each half
        alone = len(members) == 1
        residents = [
            _resident_b(view, gathers[1], tiles, [work[p] for p in picks], _itemsize(view, gathers[1]), rooms, alone)
            for (view, gathers, tiles), work in zip(members, lists, strict=True)
        ]
        if any(resident is None for resident in residents):
            residents = [None] * len(members)  # patches apart would meet the others' loads: all or none
        for pick in picks:
            finished = [
                _products(program, flags, member, work[pick], resident, a_bound, state, touch, len(cores))
                for member, work, resident in zip(members, lists, residents, strict=True)
            ]
            if on_chip:
                _epilogue_on_chip(program, flags, finished, output, output_itemsize, state, touch, len(cores))
                continue
            for (_, _, tiles), (tile, l0c, acc_slot) in zip(members, finished, strict=True):
                accumulate = tiles.splits > 1
                _store_tile(program, flags, tile, l0c, acc_slot, output, output_itemsize, workspace, accumulate)
        if residents[0] is not None:
            # the next view's loads may land where this view's resident patches lie: MTE2 waits
            # until MTE1 has read the last two steps' (the earlier ones it waited for already)
            for step in range(max(0, state[0] - 2), state[0]):
                flags.wait("MTE1", "MTE2", step % 2)
            state[0] = 0  # both halves free: the next loads wait for nothing


def _itemsize(view: GemmView, gather: Gather) -> int:
    return dt.numpy_dtype(_tensor(view, gather.tensor).dtype).itemsize


def _products(
    program: Program,
    flags: _Flags,
    member: Member,
    tile: tuple[int, int, int, range],
    resident: _ResidentB | None,
    a_bound: int,
    state: list,
    touch: FirstTouch,
    cores: int,
) -> tuple[EpilogueTile, Region, int]:
    """The loads, fractals and multiply-adds of one output ``tile`` of ``member`` on ``flags``' core,
    into its half of L0C (the core's tile count, ``state[2]``, picks it; counted here); the tile
    (as an ``EpilogueTile``), its L0C region and half, once the cube has finished it."""
    machine = program.machine
    view, gathers, tiles = member
    _, m_size, n_size, _ = view.sizes
    z, mi, ni, depth = tile
    slot_l1, l0a_slot, l0b_slot, l0c_slot = (machine.buffer(b).capacity // 2 for b in ("L1", "L0A", "L0B", "L0C"))
    rows, cols = range(mi, min(mi + tiles.m, m_size)), range(ni, min(ni + tiles.n, n_size))
    env_z = batch_env(view, z)
    count = state[2]
    acc_slot = count % 2
    l0c = Region("L0C", acc_slot * l0c_slot, _pad16(len(rows)) * _pad16(len(cols)) * ACCUMULATOR_BYTES)
    for k1 in range(depth.start, depth.stop, tiles.k1):
        half = state[0] % 2
        depth1 = range(k1, min(k1 + tiles.k1, depth.stop))
        patches = {}
        if state[0] >= 2:
            flags.wait("MTE1", "MTE2", half)
        for side, rng, base in (("a", rows, 0), ("b", cols, a_bound)):
            gather = gathers[0 if side == "a" else 1]
            if side == "b" and resident is not None:
                region, footprint, fresh = resident.patch(cols, depth1, z)
            else:
                operand = OperandTile(view, side, gather, rng, depth1, z)
                footprint = Footprint(gather.tensor, patch_offsets(operand, env_z), _itemsize(view, gather))
                region, fresh = Region("L1", half * slot_l1 + base, max(footprint.bytes, 32)), True
            patches[side] = region
            if fresh:
                touch.add(program, flags.core, footprint, gm_load(machine, flags.core, footprint, region), cores)
        flags.signal("MTE2", "MTE1", half)
        flags.wait("MTE2", "MTE1", half)
        for k0 in range(k1, depth1.stop, tiles.k0):
            slot = state[1] % 2
            depth0 = range(k0, min(k0 + tiles.k0, depth1.stop))
            if state[1] >= 2:
                flags.wait("CUBE", "MTE1", slot)
            l0 = {}
            for side, rng, name, width in (("a", rows, "L0A", l0a_slot), ("b", cols, "L0B", l0b_slot)):
                gather = gathers[0 if side == "a" else 1]
                fractal = _pad16(len(rng)) * _pad16(len(depth0)) * OPERAND_BYTES
                l0[side] = Region(name, slot * width, fractal)
                operand = OperandTile(view, side, gather, rng, depth0, z)
                layout = "zZ" if side == "a" else "nZ"
                program.add(
                    copy(
                        machine,
                        flags.core,
                        patches[side],
                        l0[side],
                        opcode="mte1.img2col",
                        moved=fractal,
                        args=(("rows", len(rng)), ("depth", len(depth0)), ("layout", layout)),
                        data=operand,
                    )
                )
            if k0 + tiles.k0 >= depth1.stop:
                flags.signal("MTE1", "MTE2", half)
            flags.signal("MTE1", "CUBE", slot)
            flags.wait("MTE1", "CUBE", slot)
            first = k0 == depth.start
            if first and count >= 2:
                flags.wait("FIXPIPE", "CUBE", acc_slot)
            program.add(mmad(machine, flags.core, l0["a"], l0["b"], l0c, len(rows), len(cols), len(depth0), first))
            flags.signal("CUBE", "MTE1", slot)
            state[1] += 1
        state[0] += 1
    flags.signal("CUBE", "FIXPIPE", acc_slot)
    flags.wait("CUBE", "FIXPIPE", acc_slot)
    state[2] += 1
    return EpilogueTile(view, rows, cols, z), l0c, acc_slot


def _store_tile(
    program: Program,
    flags: _Flags,
    tile: EpilogueTile,
    l0c: Region,
    acc_slot: int,
    output: str,
    output_itemsize: int,
    workspace: str | None,
    accumulate: bool,
) -> None:
    """FIXPIPE's drain of a finished tile in ``l0c`` to GM: into ``output`` with the epilogue on the
    way, or the raw sums into ``workspace`` (added atomically with ``accumulate``)."""
    view, rows, cols, z = tile.view, tile.rows, tile.cols, tile.batch
    env, offsets = output_offsets(view, rows, cols, z)
    epilogue = workspace is None
    extra = _epilogue_footprints(view, env) if epilogue else []
    target = output if epilogue else workspace
    itemsize = output_itemsize if epilogue else ACCUMULATOR_BYTES
    low, high = int(offsets.min()), int(offsets.max())
    points = None if epilogue else np.unique(offsets)  # a workspace: what a vector core may read
    destination = Region(GM, low * itemsize, (high - low + 1) * itemsize, target, points)
    moved = offsets.size * itemsize + sum(f.moved_bytes for f in extra)
    program.add(
        copy(
            program.machine,
            flags.core,
            l0c,
            destination,
            reads=tuple(gm_region(f) for f in extra),
            moved=moved,
            args=(("rows", len(rows)), ("cols", len(cols)), ("epilogue", epilogue), ("atomic_add", accumulate)),
            data=OutputTile(view, rows, cols, z, epilogue, workspace, accumulate),
        )
    )
    flags.signal("FIXPIPE", "CUBE", acc_slot)


class _ResidentB:
    """Operand ``b``'s patches of one core's tiles kept in L1 for the whole view, each loaded once
    (a weight read by every row tile: reloaded with each tile, it cost a capsule conv's input
    adjoint 62 times the weight's bytes).  They lie in both halves' room beside the ``a`` patches,
    each at a place of its own, so a patch is never overwritten while the view runs."""

    def __init__(self, patches: dict[tuple, tuple[Region, Footprint]], keys: dict[tuple, tuple]) -> None:
        self.patches, self.keys, self.loaded = patches, keys, set()

    def patch(self, cols: range, depth: range, z: int) -> tuple[Region, Footprint, bool]:
        """The region of the tile's ``b`` patch, its footprint, and whether it is loaded now."""
        key = self.keys[(cols.start, depth.start, z)]
        region, footprint = self.patches[key]
        fresh = key not in self.loaded
        self.loaded.add(key)
        return region, footprint, fresh


def _resident_b(
    view: GemmView,
    gather: Gather,
    tiles: CubeTiles,
    mine: list[tuple],
    itemsize: int,
    rooms: list[list[int]],
    reused_only: bool = True,
) -> _ResidentB | None:
    """Operand ``b``'s distinct patches over a core's tiles ``mine`` placed in L1 beside the
    ``a`` halves, in ``rooms`` (``[next free byte, end]`` in each half, taken here), where all of
    them fit and (``reused_only``) some patch is read by more than one tile; else None (each tile
    loads its own into the ping-pong halves)."""
    n_size = view.sizes[2]
    keys: dict[tuple, tuple] = {}
    footprints: dict[tuple, Footprint] = {}
    room = sum(end - start for start, end in rooms)  # bytes beside the two ``a`` halves
    for z, _, ni, depth in mine:
        for k1 in range(depth.start, depth.stop, tiles.k1):
            if (ni, k1, z) in keys:
                continue
            cols, depth1 = range(ni, min(ni + tiles.n, n_size)), range(k1, min(k1 + tiles.k1, depth.stop))
            offsets = patch_offsets(OperandTile(view, "b", gather, cols, depth1, z), batch_env(view, z))
            key = (offsets.size, offsets.tobytes())
            keys[(ni, k1, z)] = key
            if key not in footprints:
                footprints[key] = Footprint(gather.tensor, offsets, itemsize)
                room -= align(max(footprints[key].bytes, 32), 32)
                if room < 0:
                    return None  # they cannot all stay (the halves' rooms are checked one by one below)
    uses = sum(len(range(d.start, d.stop, tiles.k1)) for _, _, _, d in mine)
    if reused_only and len(footprints) == uses:
        return None  # no patch is read twice
    placed: dict[tuple, tuple[Region, Footprint]] = {}
    for key, footprint in footprints.items():
        size = align(max(footprint.bytes, 32), 32)
        room = next((r for r in rooms if r[0] + size <= r[1]), None)
        if room is None:
            return None
        placed[key] = (Region("L1", room[0], size), footprint)
        room[0] += size
    return _ResidentB(placed, keys)


def _after_store(flags: _Flags, pipe: str, half: int, regions: list[Region], stored: dict[int, Region]) -> None:
    """Make ``pipe`` wait, before writing ``regions`` of UB half ``half``, until MTE3 has stored the
    result the half's previous chunk left there (``stored``), where they overlap it: chunks of other
    sizes lay a half out differently.  The flag is set on MTE3 here, after every store issued so far,
    and waited for at once (so set and wait stay paired)."""
    previous = stored.get(half)
    if previous is not None and any(region.overlaps(previous) for region in regions):
        flags.signal("MTE3", pipe, half)
        flags.wait("MTE3", pipe, half)


def _chunk_rows(view: GemmView, cols: int, output_itemsize: int, machine: Machine, members: int) -> int:
    """Rows (a multiple of 16; 0 where not even 16 fit) of an on-chip epilogue's chunk: ``members``
    tiles' sums, inputs and results of ``cols`` columns in a half of UB."""
    width = machine.buffer("UB").capacity // 2
    point = epilogue_point_bytes(view, output_itemsize) * members
    return max(0, (width - 256 * (len(_epilogue_reads(view)) + 2 * members)) // (point * cols) // 16 * 16)


def _epilogue_on_chip(
    program: Program,
    flags: _Flags,
    finished: Sequence[tuple[EpilogueTile, Region, int]],
    output: str,
    output_itemsize: int,
    state: list,
    touch: FirstTouch,
    cores: int,
) -> None:
    """The epilogue of finished tiles (one, or sibling views' tiles of one shape: ``emit_views``),
    each ``(tile, its L0C region, its L0C half)``, on their core's vector unit, in chunks of rows
    that fit a half of UB: FIXPIPE drains a chunk's fp32 sums of each tile from L0C into the half,
    MTE2 brings the elements the epilogues read beside them (once for all the tiles), the vector
    unit applies each epilogue, MTE3 stores the results into GM tensor ``output``; halves ping-pong
    between chunks (``state[3]``: the core's chunks so far; ``state[4]``: per half the result MTE3
    last stored from it, ``_after_store``).  Each tile's L0C half is released to the cube after the last chunk."""
    machine = program.machine
    first = finished[0][0]
    width = machine.buffer("UB").capacity // 2
    per_chunk = max(16, _chunk_rows(first.view, len(first.cols), output_itemsize, machine, len(finished)))
    rows_all = first.rows
    chunks = [range(r, min(r + per_chunk, rows_all.stop)) for r in range(rows_all.start, rows_all.stop, per_chunk)]
    stored = state[4]
    for position, chunk_rows in enumerate(chunks):
        count, half = state[3], state[3] % 2
        state[3] += 1
        start = chunk_rows.start - rows_all.start
        parts = []  # per tile: the chunk's rows, its environment and output offsets, its sums in UB
        offset = half * width
        for tile, _, _ in finished:
            rows = range(tile.rows.start + start, tile.rows.start + start + len(chunk_rows))
            env, offsets = output_offsets(tile.view, rows, tile.cols, tile.batch)
            sums = Region("UB", offset, align(offsets.size * ACCUMULATOR_BYTES, 32))
            offset += sums.size
            parts.append((tile, rows, env, offsets, sums))
        if count >= 2:
            flags.wait("VECTOR", "FIXPIPE", half)  # the half's sums of two chunks ago are read
        _after_store(flags, "FIXPIPE", half, [part[4] for part in parts], stored)
        for (tile, rows, _, offsets, sums), (_, l0c, _) in zip(parts, finished, strict=True):
            program.add(
                copy(
                    machine,
                    flags.core,
                    l0c,
                    sums,
                    moved=offsets.size * ACCUMULATOR_BYTES,
                    args=(("rows", len(rows)), ("cols", len(tile.cols)), ("epilogue", False)),
                    data=OutputTile(tile.view, rows, tile.cols, tile.batch, False, tile_rows=tile.rows),
                )
            )
        if position == len(chunks) - 1:
            for _, _, acc_slot in finished:
                flags.signal("FIXPIPE", "CUBE", acc_slot)
        flags.signal("FIXPIPE", "VECTOR", half)
        if count >= 2:
            flags.wait("VECTOR", "MTE2", half)  # the half's inputs of two chunks ago are read
        # each tensor the epilogues read: the elements every tile's chunk needs, loaded once
        each = [_epilogue_footprints(tile.view, env) for tile, _, env, _, _ in parts]
        footprints = [_union(group) for group in zip(*each, strict=True)]
        loaded = []
        for footprint in footprints:
            loaded.append(Region("UB", offset, align(max(footprint.bytes, 32), 32)))
            offset += loaded[-1].size
        _after_store(flags, "MTE2", half, loaded, stored)
        for footprint, region in zip(footprints, loaded, strict=True):
            touch.add(program, flags.core, footprint, gm_load(machine, flags.core, footprint, region), cores)
        # the results at the half's end, the sums and inputs from its start: a chunk's writes then meet the
        # results of the half's previous chunk (still being stored) only where the two together overflow it
        end, results = (half + 1) * width, []
        for _, _, _, offsets, _ in parts:
            size = align(offsets.size * output_itemsize, 32)
            end -= size
            results.append(Region("UB", end, size))
        if offset > end:
            raise CompileError(
                f"npu: op '{first.view.op.name}': an output tile's epilogue overflows a UB half ({width} bytes)",
                op=first.view.op.name,
            )
        flags.signal("MTE2", "VECTOR", half)
        flags.wait("FIXPIPE", "VECTOR", half)
        flags.wait("MTE2", "VECTOR", half)
        if count >= 2:
            flags.wait("MTE3", "VECTOR", half)  # the half's results of two chunks ago are stored
        for (tile, rows, _, offsets, sums), result in zip(parts, results, strict=True):
            view = tile.view
            points = offsets.size
            lanes = points * (operations(view.epilogue) if view.epilogue is not None else 1)
            repeats = math.ceil(lanes * ACCUMULATOR_BYTES / machine.vector.repeat_bytes)
            chunk = EpilogueTile(view, rows, tile.cols, tile.batch)
            program.add(
                vector(
                    machine,
                    flags.core,
                    "epilogue",
                    result,
                    sums,
                    *loaded,
                    repeats=repeats,
                    data=chunk,
                    points=offsets.size,
                )
            )
        for pipe in ("FIXPIPE", "MTE2", "MTE3"):
            flags.signal("VECTOR", pipe, half)
        flags.wait("VECTOR", "MTE3", half)
        for (_, _, _, offsets, _), result in zip(parts, results, strict=True):
            low, high = int(offsets.min()), int(offsets.max())
            destination = Region(GM, low * output_itemsize, (high - low + 1) * output_itemsize, output)
            # stored bytes as FIXPIPE's stores count them: L2 absorbs the writes (``loads``)
            program.add(
                copy(machine, flags.core, result, destination, moved=offsets.size * output_itemsize, data=offsets)
            )
        flags.signal("MTE3", "VECTOR", half)
        stored[half] = Region("UB", end, (half + 1) * width - end)
