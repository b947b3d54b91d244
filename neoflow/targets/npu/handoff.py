"""A split machine's cube cores handing their sums to the vector cores tile by tile, across cores.

On a split machine (Ascend A2-like) an epilogue the cube cannot apply runs on the
vector cores, which meet the cube cores through a GM workspace of fp32 sums.
Run as two phases, the vector cores wait for the whole product.  Ascend C's
mixed cube-vector kernels instead synchronise the two kinds of core per tile
(``CrossCoreSetFlag`` / ``CrossCoreWaitFlag``), and so does ``pipelined``: one
program in which each vector core, before it loads a chunk's sums, waits on a
cross-core flag from every cube core that stored some of them, raised by that
cube core's FIXPIPE right after the store.  The chunks go to the vector cores in
the order the static schedule lands their sums (an op of several lattice pieces
runs them side by side, ``compile.pieces_side_by_side``, so that every region of
the output is complete early or late alike), and the vector cores' loads get the
share of HBM's bandwidth the cube cores' leave (``_left_to_vector``).  The program
reads a GM tensor it writes (the workspace), each element written once before
it is read, with the exact elements named on both sides (``schedule.check_gm_roles``):
the replay catches a missing cross-core flag like any other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from neoflow.ir import dtypes as dt
from neoflow.ir.op import Op
from neoflow.targets.npu import vector
from neoflow.targets.npu.isa import Instruction, Program, set_flag, wait_flag
from neoflow.targets.npu.loads import FirstTouch, count_readers, fetched_bytes
from neoflow.targets.npu.machine import GM, Machine
from neoflow.targets.npu.schedule import Schedule, static_schedule

#: the cross-core flag's id (the event that pairs a cube core's FIXPIPE with a vector core's MTE2)
HANDOFF_FLAG = 0


def _stores(program: Program, workspace: str) -> list[tuple[int, Instruction]]:
    """The instructions of ``program`` storing sums into ``workspace``, with their positions."""
    return [
        (k, i)
        for k, i in enumerate(program.instructions)
        if any(w.space == GM and w.tensor == workspace for w in i.writes)
    ]


class _Handoff:
    """Which cube core's which store wrote each workspace element, and the cross-core flags the
    vector cores' loads of those elements need (``before_sums``; ``sets``: after which store
    instruction which cube core signals which vector core)."""

    def __init__(self, stores: list[tuple[int, Instruction]], elements: int) -> None:
        self.core = np.full(elements, -1, np.int32)
        self.rank = np.full(elements, -1, np.int32)  # the store's position among its core's stores
        self.positions: dict[int, list[int]] = defaultdict(list)  # cube core -> its stores' positions
        for position, store in stores:
            points = store.writes[0].points
            self.core[points] = store.core
            self.rank[points] = len(self.positions[store.core])
            self.positions[store.core].append(position)
        self.waited: dict[tuple[int, int], int] = {}  # (vector core, cube core) -> highest rank waited for
        self.sets: dict[int, list[tuple[int, int]]] = defaultdict(list)  # store position -> (cube, vector core)

    def before_sums(self, program: Program, core: int, points: range) -> None:
        """Before vector ``core`` loads the sums at ``points``: a wait on each cube core that stored
        some of them later than the stores it has already waited for (flags pair in order)."""
        owners, ranks = self.core[points.start : points.stop], self.rank[points.start : points.stop]
        for cube_core in np.unique(owners):
            need = int(ranks[owners == cube_core].max())
            if need <= self.waited.get((core, int(cube_core)), -1):
                continue  # an earlier flag of this cube core signalled after this store already
            self.waited[(core, int(cube_core))] = need
            program.add(wait_flag(core, "FIXPIPE", "MTE2", HANDOFF_FLAG, peer=int(cube_core)))
            store = self.positions[int(cube_core)][need]
            self.sets[store].append((int(cube_core), core))


def _chunk_order(
    op: Op, machine: Machine, stores: list[tuple[int, Instruction]], schedule: Schedule, workspace: str
) -> list[int]:
    """The epilogue's chunks (``vector.chunks``) in the order ``schedule`` (of the cube's program,
    whose ``stores`` write the sums) lands the last of each one's sums (ties as they lie)."""
    landed = np.zeros(op.output.size, np.int64)
    for position, store in stores:
        landed[store.writes[0].points] = schedule.dones[position]
    ready = [int(landed[c.start : c.stop].max()) for c in vector.chunks(op, machine, workspace)]
    return sorted(range(len(ready)), key=lambda k: (ready[k], k))


def pipelined(
    op: Op,
    program: Program,
    emit_cube: Callable[[Program, FirstTouch], None],
    cube_inputs: dict[str, int],
    workspace: str,
) -> Program:
    """``program`` (empty, its tensors named) holding ``op``'s cube part (``emit_cube``, loading
    ``cube_inputs``) and its epilogue on the vector cores, pipelined through ``workspace``.

    HBM's bandwidth is shared: the cube cores' loads are charged as they run alone, the vector
    cores' get what the cube's leave (``_left_to_vector``): a first pass charges them what the cube
    leaves on average, a second what it leaves at the cycle the first pass's schedule starts them.
    """
    machine = program.machine
    cube_cores, vector_cores = machine.cores("cube"), machine.cores("vector")
    inputs = {t.name: t.size for t in op.inputs}
    itemsizes = {t.name: dt.numpy_dtype(t.dtype).itemsize for t in op.inputs}
    cube_readers = count_readers(program, cube_inputs, emit_cube, len(cube_cores))
    cube = Program(machine, dict(program.tensors))
    emit_cube(cube, FirstTouch(cube_inputs, cube_readers))
    alone = static_schedule(cube)
    stores = _stores(cube, workspace)
    order = _chunk_order(op, machine, stores, alone, workspace)
    left = _left_to_vector(cube, alone)
    bandwidth = machine.memory.hbm_bytes_per_cycle
    vector_share = max(MIN_SHARE, 1 - fetched_bytes(cube_readers, itemsizes) / max(1, alone.cycles) / bandwidth)

    def emit_vector(target: Program, touch: FirstTouch, before_sums: vector.BeforeSums | None = None) -> None:
        vector.emit_steps(target, op, vector_cores, workspace, touch, order, before_sums)

    readers = count_readers(program, inputs, emit_vector, len(vector_cores))

    def merged(shares: dict[int, list[float]] | None) -> tuple[Program, FirstTouch, int]:
        """The cube's instructions with their cross-core flags, then the vector cores' (their loads
        charged ``shares``); the touch that charged them, and where the vector cores' part starts."""
        handoff = _Handoff(stores, op.output.size)
        touch = FirstTouch(inputs, readers, vector_share, shares)
        tail = Program(machine, dict(program.tensors))
        emit_vector(tail, touch, handoff.before_sums)
        result = Program(machine, dict(program.tensors))
        for position, instruction in enumerate(cube.instructions):
            result.add(instruction)
            for cube_core, vector_core in sorted(handoff.sets.get(position, ())):
                result.add(set_flag(cube_core, "FIXPIPE", "MTE2", HANDOFF_FLAG, peer=vector_core))
        start = len(result.instructions)
        result.instructions.extend(tail.instructions)
        return result, touch, start

    first, touch, start = merged(None)
    schedule = static_schedule(first)
    shares = {
        core: [left(schedule.starts[start + position]) for position in positions]
        for core, positions in touch.charged_loads.items()
    }
    program.instructions.extend(merged(shares)[0].instructions)
    return program


#: the cycles over which the cube's use of HBM is averaged (``_left_to_vector``)
WINDOW = 512
#: the least share of HBM's bandwidth the vector cores' loads are charged at
MIN_SHARE = 0.05


def _left_to_vector(cube: Program, schedule: Schedule) -> Callable[[int], float]:
    """The share of HBM's bandwidth the cube's ``program`` leaves at a cycle, as ``schedule`` runs
    it: one less its fetches' bytes per cycle (each spread over its load's cycles) over
    ``WINDOW``-cycle windows, over the bandwidth (at least ``MIN_SHARE``)."""
    windows = np.zeros(schedule.cycles // WINDOW + 2)
    for start, instruction in zip(schedule.starts, cube.instructions, strict=True):
        if instruction.hbm:
            first, last = start, start + max(1, instruction.cycles)
            edges = np.arange(first // WINDOW, (last - 1) // WINDOW + 1)
            overlap = np.minimum(last, (edges + 1) * WINDOW) - np.maximum(first, edges * WINDOW)
            windows[edges] += instruction.hbm * overlap / (last - first)
    share = np.maximum(MIN_SHARE, 1 - windows / WINDOW / cube.machine.memory.hbm_bytes_per_cycle)
    return lambda cycle: float(share[cycle // WINDOW]) if cycle // WINDOW < share.size else 1.0
