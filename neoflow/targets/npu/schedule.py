"""The static schedule: every instruction's start cycle on its pipe, decided by the compiler.

List scheduling in program order: an instruction starts when its pipe is free
(each pipe runs its instructions in order), when every earlier instruction it
depends on is done — through a buffer region (read after write, write after
read or write), or through a GM tensor the program both writes and reads (a
read after the write of the same elements: a split machine's cube core handing
a vector core its sums, ``check_gm_roles``) — and, a ``wait_flag``, when its
``set_flag`` has signalled (a ``set_flag`` signals once every earlier instruction
on its pipe is done; a cross-core one signals another core's pipe).
The simulator's replay (``replay``) uses the flags and the pipes alone; the two
agree exactly when the flags carry every dependency.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from neoflow.errors import CompileError
from neoflow.targets.npu.isa import Instruction, Program, Region
from neoflow.targets.npu.machine import GM


@dataclass(frozen=True)
class Schedule:
    """Per instruction (program order): its start cycle, the cycle it is done, and the makespan;
    ``depends`` the earlier instructions each depends on through a buffer (``dependencies``: a
    property of the program, kept so the replay and the counters need not find them again)."""

    starts: tuple[int, ...]
    dones: tuple[int, ...]
    depends: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

    @property
    def cycles(self) -> int:
        return max(self.dones, default=0)


def scope(instruction: Instruction, region: Region) -> tuple | None:
    """Where ``region`` lives: a buffer of the instruction's core, or None for GM (whose
    dependencies inside a program ``dependencies`` finds element by element)."""
    return None if region.space == GM else (instruction.core, region.space)


def flag_key(instruction: Instruction) -> tuple:
    """What pairs a ``wait_flag`` with its ``set_flag``: the two cores and the event."""
    return (instruction.flag_cores, instruction.event)


def shared_tensors(program: Program) -> set[str]:
    """The GM tensors ``program`` both writes and reads."""
    written = {r.tensor for i in program.instructions for r in i.writes if r.space == GM}
    return {r.tensor for i in program.instructions for r in i.reads if r.space == GM and r.tensor in written}


def _element_tables(program: Program, shared: set[str], fill: int, dtype) -> dict[str, np.ndarray]:
    """Per tensor of ``shared``, an array over the elements the program's regions name, all ``fill``."""
    sizes: dict[str, int] = {}
    for instruction in program.instructions:
        for region in (*instruction.reads, *instruction.writes):
            if region.tensor in shared and region.points is not None and region.points.size:
                sizes[region.tensor] = max(sizes.get(region.tensor, 0), int(region.points.max()) + 1)
    return {name: np.full(sizes.get(name, 0), fill, dtype) for name in shared}


def check_gm_roles(program: Program) -> None:
    """A ``CompileError`` where an instruction reads a GM tensor the same program writes, unless
    every access to it names its exact elements (``Region.points``) and each element is written
    once, before any read of it: then the only dependency through it is a read after a write,
    which ``dependencies`` finds and a flag (across cores, a cross-core one) must carry."""
    shared = shared_tensors(program)
    state = _element_tables(program, shared, 0, np.int8)  # per element: 0 untouched, 1 written, 2 read
    for index, instruction in enumerate(program.instructions):
        accesses = [(r, 2) for r in instruction.reads] + [(r, 1) for r in instruction.writes]
        for region, role in accesses:
            if region.space != GM or region.tensor not in shared:
                continue
            what = f"instruction {index} ({instruction.text()})"
            if region.points is None:
                raise CompileError(
                    f"{what} {'reads' if role == 2 else 'writes'} GM tensor '{region.tensor}', which the same "
                    "program also writes and reads, without naming its elements"
                )
            seen = state[region.tensor][region.points]
            if role == 1 and seen.any():
                raise CompileError(f"{what} writes elements of GM tensor '{region.tensor}' written or read before")
            if role == 2 and (seen == 0).any():
                raise CompileError(f"{what} reads elements of GM tensor '{region.tensor}' before any write of them")
            state[region.tensor][region.points] = np.maximum(seen, role)


def _covers(outer: Region, inner: Region) -> bool:
    return outer.offset <= inner.offset and inner.offset + inner.size <= outer.offset + outer.size


def dependencies(program: Program) -> list[tuple[int, ...]]:
    """Per instruction, the earlier instructions it depends on through a buffer region (read
    after write, write after read or write: a write hides the accesses it covers) or through the
    elements of a GM tensor the program writes and reads (read after write, ``check_gm_roles``)."""
    writes: dict[tuple, list[tuple[Region, int]]] = defaultdict(list)
    reads: dict[tuple, list[tuple[Region, int]]] = defaultdict(list)
    writers = _element_tables(program, shared_tensors(program), -1, np.int32)
    found: list[tuple[int, ...]] = []
    for index, instruction in enumerate(program.instructions):
        depends: set[int] = set()
        for region in instruction.reads:
            if region.tensor in writers and region.points is not None:  # a GM read after a write (``check_gm_roles``)
                depends.update(int(i) for i in np.unique(writers[region.tensor][region.points]) if i >= 0)
        for region in instruction.writes:
            if region.tensor in writers and region.points is not None:
                writers[region.tensor][region.points] = index
        for region in instruction.reads:
            where = scope(instruction, region)
            if where is not None:
                depends.update(i for other, i in writes[where] if region.overlaps(other))
        for region in instruction.writes:
            where = scope(instruction, region)
            if where is not None:
                depends.update(i for other, i in writes[where] + reads[where] if region.overlaps(other))
        for region in instruction.reads:
            where = scope(instruction, region)
            if where is not None:
                reads[where].append((region, index))
        for region in instruction.writes:
            where = scope(instruction, region)
            if where is not None:
                for table in (writes, reads):
                    table[where][:] = [e for e in table[where] if not _covers(region, e[0])]
                writes[where].append((region, index))
        found.append(tuple(sorted(depends)))
    return found


def static_schedule(program: Program) -> Schedule:
    """The start and done cycle of every instruction of ``program`` (list scheduling in program
    order); a ``wait_flag`` whose ``set_flag`` does not come before it is a ``CompileError``."""
    pipe_free: dict[tuple, int] = defaultdict(int)
    pipe_done: dict[tuple, int] = defaultdict(int)
    signals: dict[tuple, deque[int]] = defaultdict(deque)
    depends = dependencies(program)
    starts: list[int] = []
    dones: list[int] = []
    for index, instruction in enumerate(program.instructions):
        pipe = (instruction.core, instruction.pipe)
        ready = pipe_free[pipe]
        for earlier in depends[index]:
            ready = max(ready, dones[earlier])
        if instruction.is_wait:
            waiting = signals[flag_key(instruction)]
            if not waiting:
                raise CompileError(
                    f"instruction {index} ({instruction.text()}) waits for a flag no earlier set_flag raises"
                )
            ready = max(ready, waiting.popleft())
        start, done = ready, ready + instruction.cycles + instruction.latency
        if instruction.is_set:
            signals[flag_key(instruction)].append(max(pipe_done[pipe], start + instruction.cycles))
        pipe_free[pipe] = start + instruction.cycles
        pipe_done[pipe] = max(pipe_done[pipe], done)
        starts.append(start)
        dones.append(done)
    return Schedule(tuple(starts), tuple(dones), tuple(depends))
