"""The simulator's clock: a program replayed event by event from its flags and its pipes alone.

Each pipe of each core takes its instructions in program order, and like an
in-order pipeline it holds an instruction until the earlier instructions *of its
own pipe* whose results it uses are done (the pipe's interlock: an ``mmad``
accumulating onto the previous one's sums); the next one to start is always the
pipe head that can start earliest (its pipe free, its flag signalled), ties going
to program order.  Nothing else orders instructions — across pipes only the
flags do — so the replay shows what the hardware would do with the flags as
written.  On the way it checks every access: a region inside its
buffer's capacity and aligned as the buffer requires, inside its GM tensor, and
never read before the write it depends on is done, nor overwritten before an
earlier reader or writer is done (a missing flag).  ``replay(..., against=)``
then demands that every instruction start on exactly its static-schedule cycle.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from neoflow.errors import CompileError
from neoflow.targets.npu.isa import Instruction, Program
from neoflow.targets.npu.machine import GM
from neoflow.targets.npu.schedule import Schedule, dependencies, flag_key


class SimulationError(CompileError):
    """A program the NPU would run wrongly (or not at all): names the instruction."""

    kind = "npu simulation error"


def _where(index: int, instruction: Instruction) -> str:
    return f"instruction {index} (c{instruction.core}.{instruction.pipe} {instruction.text()})"


def check_regions(program: Program) -> None:
    """Every region of every instruction inside its place, aligned as its buffer requires."""
    machine = program.machine
    kinds = {b.name: b for b in machine.buffers}
    for index, instruction in enumerate(program.instructions):
        for region in (*instruction.reads, *instruction.writes):
            if region.space == GM:
                size = program.tensors.get(region.tensor)
                if size is None:
                    raise SimulationError(f"{_where(index, instruction)} names GM tensor '{region.tensor}', unknown")
                if region.offset < 0 or region.offset + region.size > size:
                    raise SimulationError(
                        f"{_where(index, instruction)} reaches outside GM tensor '{region.tensor}' ({size} bytes)"
                    )
                continue
            buffer = kinds.get(region.space)
            if buffer is None:
                raise SimulationError(f"{_where(index, instruction)} names buffer '{region.space}', which it lacks")
            if region.offset < 0 or region.offset + region.size > buffer.capacity:
                raise SimulationError(
                    f"{_where(index, instruction)}: {region} overflows {buffer.name} ({buffer.capacity} bytes)"
                )
            if region.offset % buffer.alignment:
                raise SimulationError(
                    f"{_where(index, instruction)}: {region} is not aligned to {buffer.alignment} bytes"
                )


def replay(program: Program, against: Schedule | None = None) -> Schedule:
    """Every instruction's start and done cycle as the pipes and flags alone order them; with
    ``against`` (the static schedule) a ``SimulationError`` names the first instruction that
    starts elsewhere.  Region, alignment and hazard violations, and flags never raised, are
    ``SimulationError`` s naming the instruction."""
    check_regions(program)
    instructions = program.instructions
    queues: dict[tuple, list[int]] = defaultdict(list)
    for index, instruction in enumerate(instructions):
        queues[(instruction.core, instruction.pipe)].append(index)
    heads = {pipe: 0 for pipe in queues}
    pipe_free: dict[tuple, int] = defaultdict(int)
    pipe_done: dict[tuple, int] = defaultdict(int)
    signals: dict[tuple, list[int]] = defaultdict(list)  # every signal raised, in order
    consumed: dict[tuple, int] = defaultdict(int)  # signals taken by waits
    starts = [0] * len(instructions)
    dones = [0] * len(instructions)
    depends = against.depends if against is not None and against.depends else dependencies(program)
    executed_at: list[bool] = [False] * len(instructions)
    ready: list[tuple[int, int, tuple]] = []  # (start, program index, pipe) of heads that can start

    def offer(pipe: tuple) -> None:
        """Put ``pipe``'s head on the ready heap, if it can start (a wait needs its signal)."""
        if heads[pipe] >= len(queues[pipe]):
            return
        index = queues[pipe][heads[pipe]]
        instruction = instructions[index]
        start = pipe_free[pipe]
        for earlier in depends[index]:
            if (instructions[earlier].core, instructions[earlier].pipe) == pipe:
                start = max(start, dones[earlier])
        if instruction.is_wait:
            key = flag_key(instruction)
            if consumed[key] >= len(signals[key]):
                return  # offered again when its set_flag raises the signal
            start = max(start, signals[key][consumed[key]])
        heapq.heappush(ready, (start, index, pipe))

    for pipe in queues:
        offer(pipe)
    executed = 0
    while ready:
        start, index, pipe = heapq.heappop(ready)
        instruction = instructions[index]
        if instruction.is_wait:
            consumed[flag_key(instruction)] += 1
        done = start + instruction.cycles + instruction.latency
        for earlier in depends[index]:
            if not executed_at[earlier] or dones[earlier] > start:
                what = (
                    "overwrites"
                    if any(
                        r.overlaps(w)
                        for r in instruction.writes
                        for w in instructions[earlier].reads + instructions[earlier].writes
                    )
                    else "reads"
                )
                when = f"is done (cycle {dones[earlier]})" if executed_at[earlier] else "has even started"
                raise SimulationError(
                    f"{_where(index, instruction)} {what} a region at cycle {start}, before "
                    f"{_where(earlier, instructions[earlier])} {when}: a missing flag"
                )
        executed_at[index] = True
        starts[index], dones[index] = start, done
        if against is not None and against.starts[index] != start:
            raise SimulationError(
                f"{_where(index, instruction)} starts at cycle {start} in the replay, "
                f"{against.starts[index]} in the static schedule: the first instruction that moved"
            )
        pipe_free[pipe] = start + instruction.cycles
        pipe_done[pipe] = max(pipe_done[pipe], done)
        heads[pipe] += 1
        executed += 1
        offer(pipe)
        if instruction.is_set:
            key = flag_key(instruction)
            signals[key].append(max(pipe_done[pipe], start + instruction.cycles))
            waiting = (instruction.flag_cores[1], instruction.event[1])
            if waiting in queues and heads[waiting] < len(queues[waiting]):
                head = instructions[queues[waiting][heads[waiting]]]
                if head.is_wait and flag_key(head) == key and consumed[key] == len(signals[key]) - 1:
                    offer(waiting)
    if executed < len(instructions):
        stuck = min(queues[pipe][heads[pipe]] for pipe in queues if heads[pipe] < len(queues[pipe]))
        raise SimulationError(f"{_where(stuck, instructions[stuck])} waits for a flag that is never raised")
    return Schedule(tuple(starts), tuple(dones), tuple(depends))
