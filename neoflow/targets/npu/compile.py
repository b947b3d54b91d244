"""An op as NPU programs: the cube for contractions the AMOS mapper places, the vector unit for the rest.

``compile_op`` returns an ``OpProgram``: the op's *phases*, programs run one
after another with a barrier between them (every core done before the next
starts): a zeroing phase where the contraction's pieces leave elements unwritten,
the cube phase (every lattice piece's tiles over the cube cores), and — an
epilogue reading other tensors that cannot run on chip (``cube.vector_epilogue``:
a split machine, or cores splitting the depth) — a vector phase applying it from
the fp32 workspace.  On a split machine whose cube cores each finish their sums,
the cube and vector phases are one program instead, the vector cores taking each
tile's sums as soon as they are stored (``handoff``).  Any op that is no such
contraction is one vector phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from neoflow.codegen.hardware import NPU_CUBE
from neoflow.codegen.implicit_gemm import covers_output, gemm_views
from neoflow.ir import dtypes as dt
from neoflow.ir.op import Op
from neoflow.targets.npu import cube, handoff, vector
from neoflow.targets.npu.isa import Program, Region, copy, set_flag, wait_flag
from neoflow.targets.npu.isa import vector as vector_instruction
from neoflow.targets.npu.loads import FirstTouch, fetched
from neoflow.targets.npu.machine import GM, Machine
from neoflow.targets.npu.schedule import Schedule, check_gm_roles, static_schedule

#: bytes of UB a zeroing phase fills once and stores from
ZERO_BYTES = 32 << 10


def workspace_name(op: Op) -> str:
    """The GM workspace of ``op``'s fp32 sums (an epilogue applied by a vector phase)."""
    return f"{op.name}__sums"


@dataclass
class OpProgram:
    """The phases of one op (``(what, program)`` in order), each with its static schedule."""

    op: Op
    phases: list[tuple[str, Program]]
    #: schedules already made while compiling, by phase position (not made again)
    known: dict[int, Schedule] = field(default_factory=dict)

    @cached_property
    def schedules(self) -> list[Schedule]:
        return [self.known.get(k) or static_schedule(program) for k, (_, program) in enumerate(self.phases)]

    @property
    def cycles(self) -> int:
        """The op's cycles: its phases one after another."""
        return sum(s.cycles for s in self.schedules)

    @property
    def units(self) -> str:
        """Which units run the op (``cube``, ``vector``, ``cube+vector``)."""
        kinds = {kind for what, _ in self.phases if what != "zero" for kind in what.split("+")}
        return "+".join(k for k in ("cube", "vector") if k in kinds) or "vector"


def _tensors(op: Op, extra: dict[str, int] | None = None) -> dict[str, int]:
    sizes = {t.name: t.size * dt.numpy_dtype(t.dtype).itemsize for t in op.inputs}
    sizes[op.name] = op.output.size * dt.numpy_dtype(op.dtype).itemsize
    sizes.update(extra or {})
    return sizes


def _emit_zeros(program: Program, tensor: str, total: int) -> None:
    """Append zeros over GM tensor ``tensor`` (``total`` bytes: an op's output or its workspace) to
    ``program``: the vector unit fills a UB block once, MTE3 stores it over the tensor from every
    vector core."""
    machine = program.machine
    block = min(ZERO_BYTES, -(-total // 32) * 32)
    pieces = [(start, min(block, total - start)) for start in range(0, total, block)]
    cores = machine.cores("vector")
    for position, core in enumerate(cores):
        mine = pieces[position :: len(cores)]
        if not mine:
            continue
        ub = Region("UB", 0, block)
        program.add(vector_instruction(machine, core, "dup", ub, value=0))
        program.add(set_flag(core, "VECTOR", "MTE3", 0))
        program.add(wait_flag(core, "VECTOR", "MTE3", 0))
        for start, size in mine:
            program.add(copy(machine, core, Region("UB", 0, size), Region(GM, start, size, tensor), data="zero"))


def zeros_land_first(program: Program, schedule: Schedule, tensor: str) -> bool:
    """Whether, in ``schedule``, every zero ``program`` stores over GM tensor ``tensor`` is done
    before any other write to it starts (the static schedule is the machine's: no flag is needed
    across cores where the cycles themselves keep the order)."""
    zeros, others = [], []
    for k, instruction in enumerate(program.instructions):
        if any(w.space == GM and w.tensor == tensor for w in instruction.writes):
            (zeros if instruction.data == "zero" else others).append(k)
    return not zeros or not others or max(schedule.dones[k] for k in zeros) <= min(schedule.starts[k] for k in others)


#: tile candidates (best first by the estimate) whose busiest core is scheduled to pick among
TRIALS = 8


def _best_tiles(
    op: Op, view, gathers, machine: Machine, cores: range, fixpipe: bool, on_chip: bool, lone: bool = False
) -> tuple[cube.CubeTiles, bool]:
    """Of the estimate's best ``TRIALS`` tilings, the one whose busiest core's program the static
    schedule finishes first (a pass over the fp32 workspace added at the estimate's rate), and
    whether its epilogue runs on chip.  ``fixpipe``: FIXPIPE applies the epilogue; else, with
    ``on_chip`` (``cube.vector_epilogue``), the vector unit beside the cube can, for an undivided
    depth — tried against the tilings that split the depth and meet in the workspace."""
    itemsize = dt.numpy_dtype(op.dtype).itemsize
    candidates = cube.tile_candidates(view, machine, gathers, len(cores), lone=lone)
    # the usual eight best, and (a lone view) the best tilings that take all of L0C, which the estimate underrates
    found = [t for t in candidates if not cube.whole_l0c(t, machine)][:TRIALS]
    found += [t for t in candidates if cube.whole_l0c(t, machine)][: TRIALS // 2]
    if on_chip:
        point = cube.epilogue_point_bytes(view, itemsize)
        undivided = [t for t in cube.tile_candidates(view, machine, gathers, len(cores), point) if t.splits == 1]
        families = [(t, True) for t in undivided[:TRIALS]] + [(t, False) for t in found if t.splits > 1]
    else:
        families = [(t, False) for t in found]
    if len(families) == 1:
        return families[0]
    workspace = workspace_name(op)
    extra = {workspace: op.output.size * cube.ACCUMULATOR_BYTES}
    rate = min(machine.mover(GM, "UB").bytes_per_cycle, machine.memory.l2_bytes_per_cycle / len(cores))
    timed = []
    readers: dict[tuple, dict] = {}
    for tiles, through_ub in families:
        trial = Program(machine, _tensors(op, extra))
        sink = workspace if tiles.splits > 1 or not (fixpipe or through_ub) else None

        def emit(target: Program, touch: FirstTouch, busiest: bool, tiles=tiles, sink=sink, through_ub=through_ub):
            member = [(view, gathers, tiles)]
            cube.emit_views(target, member, cores, op.name, itemsize, sink, {}, touch, busiest, through_ub)

        # the busiest core alone, its loads charged their share of the HBM fetches of elements other cores
        # read too (counted over every core's loads: charged in full, a tiling whose cores share their
        # operands looked slower than it runs; conv2d's weight adjoint took the slower of two by 7 %)
        loads = (tiles.m, tiles.n, tiles.k1, tiles.splits)  # what the loads depend on: not k0
        if loads not in readers:
            counting = FirstTouch(_inputs(op))
            emit(Program(machine, dict(trial.tensors)), counting, False)
            readers[loads] = counting.readers
        emit(trial, FirstTouch(_inputs(op), readers[loads]), True)
        cycles = static_schedule(trial).cycles
        # the workspace's passes: zeroing, the atomic adds, the vector's read (a split); the store and the read
        passes = 0 if sink is None else 3 if tiles.splits > 1 else 2
        if passes:
            cycles += passes * op.output.size * cube.ACCUMULATOR_BYTES / (rate * len(cores)) + 1000
        timed.append((cycles, len(timed), (tiles, through_ub)))
    return min(timed)[2]


def _inputs(op: Op) -> dict[str, int]:
    """The elements of each of ``op``'s inputs (what its loads fetch from HBM)."""
    return {t.name: t.size for t in op.inputs}


def compile_op(op: Op, machine: Machine, hand_off: bool = True) -> OpProgram:
    """The NPU phases of ``op`` on ``machine`` (``hand_off``: a split machine's cube and vector cores
    may meet tile by tile, ``handoff``; else in two phases)."""
    views = gemm_views(op, NPU_CUBE) if op.scatter is None else None
    gathers = [cube.cube_operands(v) for v in views] if views else None
    if not views or any(g is None for g in gathers):
        program = Program(machine, _tensors(op))
        vector.emit_op(program, op, machine.cores("vector"))
        return _checked(OpProgram(op, [("vector", program)]))
    phases: list[tuple[str, Program]] = []
    cores = machine.cores("cube")
    fixpipe = all(cube.fixpipe_epilogue(v) for v in views)
    on_chip = not fixpipe and covers_output(op, views) and cube.vector_epilogue(machine)
    chosen = [
        _best_tiles(op, view, pair, machine, cores, fixpipe, on_chip, len(views) == 1)
        for view, pair in zip(views, gathers, strict=True)
    ]
    tiles = [t for t, _ in chosen]
    on_chip = all(fits for _, fits in chosen)  # every piece's tiling undivided, its epilogue in UB
    split = any(t.splits > 1 for t in tiles)
    direct = on_chip or (fixpipe and not split)
    workspace = None if direct else workspace_name(op)
    extra = {} if direct else {workspace: op.output.size * cube.ACCUMULATOR_BYTES}
    zeroed = None
    if split or not covers_output(op, views):  # split partial sums add onto zeros
        zeroed = op.name if direct else workspace
    itemsize = dt.numpy_dtype(op.dtype).itemsize
    handing_off = hand_off and workspace is not None and zeroed is None and machine.layout == "split"

    def emit_piece(target: Program, v: int, touch: FirstTouch, steps: dict, only: dict | None = None) -> None:
        """Append view (lattice piece) ``v``'s tiles (``only``: those ``cube.emit_views`` names) to ``target``."""
        member = [(views[v], gathers[v], tiles[v])]
        cube.emit_views(target, member, cores, op.name, itemsize, workspace, steps, touch, on_chip=on_chip, only=only)

    def emit(target: Program, touch: FirstTouch) -> None:
        steps: dict[int, list[int]] = {}
        for v in range(len(views)):
            emit_piece(target, v, touch, steps)

    tensors = _tensors(op, extra)

    def build(zeros: bool) -> Program:
        program = Program(machine, dict(tensors))
        if zeros:  # on the vector units while the cubes start, done long before the first sum lands
            _emit_zeros(program, zeroed, tensors[zeroed])
        fetched(program, _inputs(op), emit, len(cores))
        return program

    # the zeros go in the cube phase where the vector units have nothing else to do there (an
    # on-chip epilogue uses them) and the static schedule lands them before any sum; else a phase first
    known: dict[int, Schedule] = {}
    program = build(zeroed is not None and not on_chip)
    if zeroed is not None and not on_chip:
        schedule = static_schedule(program)
        if zeros_land_first(program, schedule, zeroed):
            known[len(phases)] = schedule
            zeroed = None  # the zeros are in the cube phase
        else:
            program = build(False)
    if on_chip and zeroed is None and len(views) > 1:
        # lattice pieces sharing their epilogue loads, kept where the static schedule is no slower
        alone = static_schedule(program)
        program, known[len(phases)] = alone_or_siblings(op, program, alone, views, gathers, tiles, cores)
    if zeroed is not None:
        zeros = Program(machine, dict(tensors))
        _emit_zeros(zeros, zeroed, tensors[zeroed])
        phases.append(("zero", zeros))
    phases.append(("cube", program))
    if workspace is not None:
        tail = Program(machine, dict(tensors))
        vector.emit_op(tail, op, machine.cores("vector"), accumulator=workspace)
        phases.append(("vector", tail))
    compiled = _checked(OpProgram(op, phases, known))
    if handing_off:

        def emit_side_by_side(target: Program, touch: FirstTouch) -> None:
            steps: dict[int, list[int]] = {}
            for position, (v, mine) in enumerate(pieces_side_by_side(views, tiles, len(cores))):
                emit_piece(target, v, touch, steps, only={position: mine})

        # the vector cores take each tile's sums as soon as a cube core has stored them: kept where
        # its schedule beats the two phases' (a weight update's every chunk waits for the last tiles)
        side_by_side = emit_side_by_side if 1 < len(views) <= len(cores) else emit
        program = handoff.pipelined(op, Program(machine, dict(tensors)), side_by_side, _inputs(op), workspace)
        merged = OpProgram(op, [("cube+vector", program)])
        if merged.cycles < compiled.cycles:
            return _checked(merged)

    return compiled


def alone_or_siblings(
    op: Op, program: Program, alone: Schedule, views, gathers, tiles: list[cube.CubeTiles], cores: range
) -> tuple[Program, Schedule]:
    """``program`` (each lattice piece's tiles on their own, on-chip epilogues; its ``alone``
    schedule) or, where its static schedule is no slower, the program that takes the pieces in
    ``sibling_groups``, with its schedule."""
    machine = program.machine
    itemsize = dt.numpy_dtype(op.dtype).itemsize
    groups = sibling_groups(views, gathers, tiles, itemsize, machine)
    if all(len(group) == 1 for group in groups):
        return program, alone

    def emit(target: Program, touch: FirstTouch) -> None:
        steps: dict[int, list[int]] = {}
        for group in groups:
            members = [(views[v], gathers[v], tiles[v]) for v in group]
            cube.emit_views(target, members, cores, op.name, itemsize, None, steps, touch, on_chip=True)

    paired = Program(machine, dict(program.tensors))
    fetched(paired, _inputs(op), emit, len(cores))
    together = static_schedule(paired)
    return (paired, together) if together.cycles <= alone.cycles else (program, alone)


def sibling_groups(views, gathers, tiles: list[cube.CubeTiles], itemsize: int, machine: Machine) -> list[list[int]]:
    """The views (lattice pieces) in the order they are emitted, as groups: a pair that
    ``cube.siblings`` says gains by sharing its epilogue loads, each other view alone (pairs
    taken greedily, each view with the first later one it pairs with)."""
    members = list(zip(views, gathers, tiles, strict=True))
    groups, taken = [], set()
    for v in range(len(views)):
        if v in taken:
            continue
        later = (w for w in range(v + 1, len(views)) if w not in taken)
        mate = next((w for w in later if cube.siblings([members[v], members[w]], itemsize, machine)), None)
        groups.append([v] if mate is None else [v, mate])
        taken.update(groups[-1])
    return groups


def _tile_work(view, tiles: cube.CubeTiles, tile: tuple) -> int:
    """The multiply-adds of ``tile`` (one of ``cube.tile_order``'s) of ``view``."""
    _, m_size, n_size, _ = view.sizes
    _, mi, ni, depth = tile
    return len(range(mi, min(mi + tiles.m, m_size))) * len(range(ni, min(ni + tiles.n, n_size))) * len(depth)


def pieces_side_by_side(views, tiles: list[cube.CubeTiles], cores: int) -> list[tuple[int, list[int]]]:
    """Per core (position), the view it works on and its tiles (positions in ``cube.tile_order``):
    the cores shared among the views (lattice pieces) so that the most work a core of any view has
    is least (each view at least one core; ``cores`` at least the views), each view's tiles dealt
    round-robin over its cores in order.  Every piece's sums then land from first to last at once,
    so that every region of the output is complete early or late alike, not piece after piece; and
    a core's tiles, all of one view, keep their ``b`` patches resident as in one view's program."""
    orders = [cube.tile_order(v, t) for v, t in zip(views, tiles, strict=True)]
    work = [sum(_tile_work(v, t, tile) for tile in o) for v, t, o in zip(views, tiles, orders, strict=True)]
    counts = [1] * len(views)
    for _ in range(cores - len(views)):
        busiest = max(range(len(views)), key=lambda v: (work[v] / counts[v], -v))
        counts[busiest] += 1
    found = []
    for v, count in enumerate(counts):
        found += [(v, list(range(k, len(orders[v]), count))) for k in range(count)]
    return found


def _checked(compiled: OpProgram) -> OpProgram:
    for _, program in compiled.phases:
        check_gm_roles(program)
    return compiled
