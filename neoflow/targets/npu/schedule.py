"""The static schedule: every instruction's start cycle on its pipe, decided by the compiler.

List scheduling in program order: an instruction starts when its pipe is free
(each pipe runs its instructions in order), when every earlier instruction it
depends on through a buffer or GM region (read after write, write after read or
write) is done, and — a ``wait_flag`` — when its ``set_flag`` has signalled
(a ``set_flag`` signals once every earlier instruction on its pipe is done).
The simulator's replay (``replay``) uses the flags and the pipes alone; the two
agree exactly when the flags carry every dependency.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from neoflow.errors import CompileError
from neoflow.targets.npu.isa import Instruction, Program, Region
from neoflow.targets.npu.machine import GM


@dataclass(frozen=True)
class Schedule:
    """Per instruction (program order): its start cycle, the cycle it is done, and the makespan."""

    starts: tuple[int, ...]
    dones: tuple[int, ...]

    @property
    def cycles(self) -> int:
        return max(self.dones, default=0)


def scope(instruction: Instruction, region: Region) -> tuple:
    """Where ``region`` lives: a buffer of the instruction's core, or a GM tensor (shared by all cores)."""
    return (GM, region.tensor) if region.space == GM else (instruction.core, region.space)


def flag_key(instruction: Instruction) -> tuple:
    return (instruction.core, instruction.event)


class _Accesses:
    """The accesses made so far to each place, for finding the earlier instructions one depends on."""

    def __init__(self) -> None:
        self.by_scope: dict[tuple, list[tuple[Region, int, bool]]] = defaultdict(list)

    def dependencies(self, instruction: Instruction) -> set[int]:
        found = set()
        for writing, regions in ((False, instruction.reads), (True, instruction.writes)):
            for region in regions:
                for other, index, other_writes in self.by_scope[scope(instruction, region)]:
                    if (writing or other_writes) and region.overlaps(other):
                        found.add(index)
        return found

    def record(self, instruction: Instruction, index: int) -> None:
        for writing, regions in ((False, instruction.reads), (True, instruction.writes)):
            for region in regions:
                entries = self.by_scope[scope(instruction, region)]
                if writing:  # a write hides every earlier access it covers
                    entries[:] = [e for e in entries if not _covers(region, e[0])]
                entries.append((region, index, writing))


def _covers(outer: Region, inner: Region) -> bool:
    return outer.offset <= inner.offset and inner.offset + inner.size <= outer.offset + outer.size


def static_schedule(program: Program) -> Schedule:
    """The start and done cycle of every instruction of ``program`` (list scheduling in program
    order); a ``wait_flag`` whose ``set_flag`` does not come before it is a ``CompileError``."""
    pipe_free: dict[tuple, int] = defaultdict(int)
    pipe_done: dict[tuple, int] = defaultdict(int)
    signals: dict[tuple, deque[int]] = defaultdict(deque)
    accesses = _Accesses()
    starts: list[int] = []
    dones: list[int] = []
    for index, instruction in enumerate(program.instructions):
        pipe = (instruction.core, instruction.pipe)
        ready = pipe_free[pipe]
        for earlier in accesses.dependencies(instruction):
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
        accesses.record(instruction, index)
        starts.append(start)
        dones.append(done)
    return Schedule(tuple(starts), tuple(dones))
