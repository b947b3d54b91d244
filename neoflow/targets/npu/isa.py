"""The NPU's instructions: typed, with explicit buffer regions, costed by the machine description.

A ``Program`` is what the NPU compiler emits and the simulator runs: for each
core, instructions in program order, each bound to the pipe that executes it
(``MTE2``, ``MTE1``, ``CUBE``, ``FIXPIPE``, ``VECTOR``, ``MTE3``); pipes run
concurrently and meet only through ``set_flag`` / ``wait_flag`` pairs, as on an
Ascend AI core.  An instruction names the regions it reads and writes (a buffer
or a GM tensor, a byte offset, a byte count), which is what lets the simulator
catch a read before the write it depends on, an overflowing tile or a
misaligned address.  ``Program.listing`` is the readable assembly (``program.s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from neoflow.errors import CompileError
from neoflow.targets.npu.machine import GM, Machine

#: the pipes of a core, in the order a listing shows them
PIPES = ("MTE2", "MTE1", "CUBE", "FIXPIPE", "VECTOR", "MTE3")
#: cycles a flag instruction holds its pipe
FLAG_CYCLES = 1


@dataclass(frozen=True)
class Region:
    """``size`` bytes at byte ``offset`` of ``space``: a buffer's name, or ``GM`` with the ``tensor``
    they belong to (offsets within it)."""

    space: str
    offset: int
    size: int
    tensor: str | None = None
    #: a GM region's exact elements (flat indices into its tensor, sorted), where the range holds
    #: others too: what lets a program read a GM tensor it writes (``schedule.dependencies``)
    points: np.ndarray | None = field(default=None, compare=False, repr=False)

    def overlaps(self, other: Region) -> bool:
        if self.space != other.space or self.tensor != other.tensor:
            return False
        return self.offset < other.offset + other.size and other.offset < self.offset + self.size

    def __str__(self) -> str:
        where = f"{self.space}:{self.tensor}" if self.space == GM else self.space
        return f"{where}[{self.offset}:{self.offset + self.size}]"


@dataclass(frozen=True)
class Instruction:
    """One instruction of ``core``: ``opcode`` on ``pipe``, holding it ``cycles`` and done ``latency``
    cycles after that; ``event`` ``(source pipe, destination pipe, id)`` for a flag, and ``peer``
    the other core of a cross-core flag (a split machine's cube core signalling a vector core);
    ``args`` what the functional simulator needs (shapes, the vector operation, conversions)."""

    opcode: str
    pipe: str
    core: int
    reads: tuple[Region, ...] = ()
    writes: tuple[Region, ...] = ()
    cycles: int = 1
    latency: int = 0
    event: tuple[str, str, int] | None = None
    peer: int | None = None
    args: tuple[tuple[str, object], ...] = ()
    #: bytes a copy moves (what the counters add up per path), and of those the bytes fetched from HBM
    moved: int = 0
    hbm: int = 0
    #: what the functional simulator computes (``simulate``): a spec of the data moved or combined
    data: object = field(default=None, compare=False, repr=False)

    @property
    def is_set(self) -> bool:
        return self.opcode == "set_flag"

    @property
    def is_wait(self) -> bool:
        return self.opcode == "wait_flag"

    def text(self) -> str:
        """The instruction as a line of assembly (without its start cycle)."""
        if self.event is not None:
            source, destination, number = self.event
            if self.peer is not None and self.is_set:  # the other end on another core
                destination = f"c{self.peer}.{destination}"
            elif self.peer is not None:
                source = f"c{self.peer}.{source}"
            return f"{self.opcode} {source}->{destination} #{number}"
        operands = [str(r) for r in self.writes] + [str(r) for r in self.reads]
        extra = [f"{k}={v}" for k, v in self.args]
        return f"{self.opcode} " + ", ".join(operands + extra)

    @property
    def flag_cores(self) -> tuple[int, int]:
        """A flag's (signalling core, waiting core): both the instruction's own but for a cross-core flag."""
        other = self.core if self.peer is None else self.peer
        return (self.core, other) if self.is_set else (other, self.core)


@dataclass
class Program:
    """Instructions in program order (each naming its core) and the GM tensors they may touch
    (name -> bytes)."""

    machine: Machine
    tensors: dict[str, int] = field(default_factory=dict)
    instructions: list[Instruction] = field(default_factory=list)

    def add(self, instruction: Instruction) -> int:
        """Append ``instruction``; its position."""
        if instruction.pipe not in PIPES:
            raise CompileError(f"instruction {instruction.opcode}: unknown pipe '{instruction.pipe}'")
        self.instructions.append(instruction)
        return len(self.instructions) - 1

    def listing(self, starts: list[int] | None = None) -> str:
        """The program as assembly: a line an instruction, ``core.pipe`` and (with a schedule) its
        start cycle first."""
        lines = [f"; npu program for '{self.machine.name}': {len(self.instructions)} instructions"]
        lines += [f"; GM tensor {name}: {size} bytes" for name, size in self.tensors.items()]
        for k, instruction in enumerate(self.instructions):
            cycle = f"@{starts[k]:<8d} " if starts is not None else ""
            lines.append(f"{k:5d}  {cycle}c{instruction.core}.{instruction.pipe:8s} {instruction.text()}")
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- costed instructions


def _movement(machine: Machine, source: str, destination: str, nbytes: int) -> tuple[str, int, int]:
    mover = machine.mover(source, destination)
    moved = math.ceil(nbytes / mover.burst) * mover.burst
    return mover.name, max(1, math.ceil(moved / mover.bytes_per_cycle)), mover.latency


#: the opcode of a copy on each mover's pipe
COPY_OPCODES = {"MTE2": "mte2.copy", "MTE1": "mte1.copy", "FIXPIPE": "fixpipe.store", "MTE3": "mte3.copy"}


def copy(
    machine: Machine,
    core: int,
    source: Region,
    destination: Region,
    opcode: str | None = None,
    reads: tuple[Region, ...] = (),
    moved: int | None = None,
    args: tuple[tuple[str, object], ...] = (),
    data: object = None,
) -> Instruction:
    """A copy of ``source`` into ``destination`` on the mover serving that path (``mte2.copy``,
    ``mte1.copy``, ``fixpipe.store``, ``mte3.copy``), costed by its bandwidth and bursts: ``moved``
    bytes (default: the destination's size; a gather, an img2col or a conversion moves another
    count), ``reads`` further regions it reads (a bias), ``data`` what the functional simulator does."""
    if moved is None and source.size != destination.size:
        raise CompileError(f"a copy of {source} into {destination}: sizes differ")
    moved = destination.size if moved is None else moved
    pipe, cycles, latency = _movement(machine, source.space, destination.space, moved)
    opcode = opcode or COPY_OPCODES[pipe]
    return Instruction(
        opcode, pipe, core, (source, *reads), (destination,), cycles, latency, args=args, moved=moved, data=data
    )


def mmad(
    machine: Machine, core: int, a: Region, b: Region, c: Region, m: int, n: int, k: int, init: bool
) -> Instruction:
    """``c (+)= a @ b`` on the cube: ``m x k`` fractals of L0A times ``k x n`` of L0B into L0C, one
    ``cube.m x cube.n x cube.k`` step a cycle; ``init`` starts the sum instead of adding to it."""
    cube = machine.cube
    cycles = math.ceil(m / cube.m) * math.ceil(n / cube.n) * math.ceil(k / cube.k)
    reads = (a, b) if init else (a, b, c)
    args = (("m", m), ("n", n), ("k", k), ("init", init))
    return Instruction("cube.mmad", "CUBE", core, reads, (c,), cycles, cube.latency, args=args, data=(m, n, k, init))


def vector(
    machine: Machine,
    core: int,
    operation: str,
    out: Region,
    *inputs: Region,
    repeats: int | None = None,
    data: object = None,
    **args,
) -> Instruction:
    """A vector operation (``vec.<operation>``) over UB regions, one repeat of
    ``vector.repeat_bytes`` bytes a cycle: ``repeats`` of them (default: one pass over the
    widest operand)."""
    if repeats is None:
        widest = max([out.size, *(r.size for r in inputs)])
        repeats = math.ceil(widest / machine.vector.repeat_bytes)
    extra = tuple(sorted(args.items()))
    return Instruction(
        f"vec.{operation}",
        "VECTOR",
        core,
        inputs,
        (out,),
        max(1, repeats),
        machine.vector.latency,
        args=extra,
        data=data,
    )


def set_flag(core: int, source: str, destination: str, number: int, peer: int | None = None) -> Instruction:
    """On pipe ``source``: signal ``destination`` (of core ``peer``: a cross-core flag, Ascend C's
    ``CrossCoreSetFlag``; default: this core's) once every earlier instruction of ``source`` is done."""
    event = (source, destination, number)
    return Instruction("set_flag", source, core, cycles=FLAG_CYCLES, event=event, peer=peer)


def wait_flag(core: int, source: str, destination: str, number: int, peer: int | None = None) -> Instruction:
    """On pipe ``destination``: hold it until ``source``'s matching ``set_flag`` (on core ``peer``, a
    cross-core flag; default: this core) has signalled."""
    event = (source, destination, number)
    return Instruction("wait_flag", destination, core, cycles=FLAG_CYCLES, event=event, peer=peer)
