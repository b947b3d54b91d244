"""The static schedule: every instruction's start cycle on its pipe, decided by the compiler.

List scheduling in program order: an instruction starts when its pipe is free
(each pipe runs its instructions in order), when every earlier instruction it
depends on through a buffer region (read after write, write after read or
write; GM carries none inside a program, ``check_gm_roles``) is done, and —
a ``wait_flag`` — when its ``set_flag`` has signalled
(a ``set_flag`` signals once every earlier instruction on its pipe is done).
The simulator's replay (``replay``) uses the flags and the pipes alone; the two
agree exactly when the flags carry every dependency.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

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
    """Where ``region`` lives: a buffer of the instruction's core, or None for GM.  Within one
    program GM carries no dependencies: a program reads its inputs and writes each element of
    its outputs once, from one core (the compiler's invariant, ``check_gm_roles``); programs
    are ordered by the barrier between them."""
    return None if region.space == GM else (instruction.core, region.space)


def flag_key(instruction: Instruction) -> tuple:
    return (instruction.core, instruction.event)


def check_gm_roles(program: Program) -> None:
    """A ``CompileError`` where an instruction reads a GM tensor another writes (a dependency
    through GM inside one program, which no flag could carry across cores)."""
    written = {r.tensor for i in program.instructions for r in i.writes if r.space == GM}
    for index, instruction in enumerate(program.instructions):
        for region in instruction.reads:
            if region.space == GM and region.tensor in written:
                raise CompileError(
                    f"instruction {index} ({instruction.text()}) reads GM tensor '{region.tensor}', "
                    "which the same program writes"
                )


def _covers(outer: Region, inner: Region) -> bool:
    return outer.offset <= inner.offset and inner.offset + inner.size <= outer.offset + outer.size


def dependencies(program: Program) -> list[tuple[int, ...]]:
    """Per instruction, the earlier instructions it depends on through a buffer region: read
    after write, write after read or write (a write hides the accesses it covers)."""
    writes: dict[tuple, list[tuple[Region, int]]] = defaultdict(list)
    reads: dict[tuple, list[tuple[Region, int]]] = defaultdict(list)
    found: list[tuple[int, ...]] = []
    for index, instruction in enumerate(program.instructions):
        depends: set[int] = set()
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
