"""GM loads: what MTE2 moves from L2 and what it must first fetch from HBM.

A program's first read of a GM element misses L2 and comes from HBM, whose
bandwidth the cores loading at the time share; later reads of it by the same
core (a convolution's overlapping windows, an operand tile read once per output
tile) hit L2.  Cores reading the same element (a weight every core multiplies
by) fetch it together, as their requests meet in L2: each pays its share of the
fetch.  A load then takes the longer of its mover's time and its HBM bytes' time
at the program's share of HBM.  The shares are known once the whole program is
(``fetched``: a first pass counts each element's readers).  Each op's programs start with a cold L2 for its inputs
(an upper bound: a producer's output may still sit in L2); writes are absorbed
by L2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from neoflow.targets.npu.data import Footprint
from neoflow.targets.npu.isa import Instruction, Program, Region, copy
from neoflow.targets.npu.machine import GM, Machine


class FirstTouch:
    """A program's GM input loads (tensors: name -> elements) and their HBM fetches.

    Counting (no ``readers``): each element's readers, the cores reading it.  Charging (the
    ``readers`` a counting pass of the same program found): each load's fetch, every element a
    core reads for the first time costing its bytes over its readers (rounded so that the
    charges add up to the bytes of the elements read).  ``fetched`` runs both passes."""

    def __init__(
        self,
        tensors: dict[str, int],
        readers: dict[str, np.ndarray] | None = None,
        share: float = 1.0,
        shares: dict[int, list[float]] | None = None,
    ) -> None:
        self.counting = readers is None
        # of HBM's bandwidth, what these loads' cores have (the rest serves other cores), or per core
        # the share of each of its input loads in order (past the list: ``share``)
        self.share, self.shares = share, shares or {}
        self.charged_loads: dict[int, list[int]] = {}  # per core, the positions of the loads it charged
        counts = {name: np.zeros(size, np.int32) for name, size in tensors.items()} if readers is None else None
        self.readers = counts if readers is None else readers
        self.seen = {name: np.zeros(size, bool) for name, size in tensors.items()}
        self.core: int | None = None  # the core whose loads are being added: a core's loads come together
        self.charged = 0.0  # fetched bytes charged so far, exactly, and rounded
        self.rounded = 0

    def add(self, program: Program, core: int, footprint: Footprint, load: Instruction, cores: int) -> int:
        """Append ``load`` (of ``footprint``, by ``core``, ``cores`` cores sharing ``share`` of HBM) to ``program``."""
        seen = self.seen.get(footprint.tensor)
        if seen is None or footprint.offsets.size == 0:
            return program.add(load)
        if core != self.core:
            for array in self.seen.values():
                array[:] = False
            self.core = core
        offsets = footprint.offsets  # sorted and unique
        fresh = offsets[~seen[offsets]]
        seen[fresh] = True
        readers = self.readers[footprint.tensor]
        if self.counting:
            readers[fresh] += 1
            return program.add(load)
        self.charged += float(np.sum(footprint.itemsize / np.maximum(readers[fresh], 1)))
        hbm = round(self.charged) - self.rounded
        self.rounded += hbm
        positions = self.charged_loads.setdefault(core, [])
        own = self.shares.get(core, ())
        share = own[len(positions)] if len(positions) < len(own) else self.share
        rate = program.machine.memory.hbm_bytes_per_cycle * share / max(1, cores)
        charged = dataclasses.replace(
            load, cycles=max(load.cycles, math.ceil(hbm / rate)), hbm=hbm, args=(*load.args, ("hbm_bytes", hbm))
        )
        positions.append(program.add(charged))
        return positions[-1]


def count_readers(
    program: Program, tensors: dict[str, int], emit: Callable[[Program, FirstTouch], None], cores: int
) -> dict[str, np.ndarray]:
    """Per input tensor, how many cores read each element, from a pass of ``emit`` into a scratch
    copy of ``program`` (on one core, each element has one reader)."""
    if cores == 1:
        return {name: np.ones(size, np.int32) for name, size in tensors.items()}
    counting = FirstTouch(tensors)
    emit(Program(program.machine, dict(program.tensors)), counting)
    return counting.readers


def fetched_bytes(readers: dict[str, np.ndarray], itemsizes: dict[str, int]) -> int:
    """The HBM bytes of the elements ``readers`` (``count_readers``) says some core reads."""
    return sum(int(np.count_nonzero(counts)) * itemsizes[name] for name, counts in readers.items())


def fetched(program: Program, tensors: dict[str, int], emit: Callable[[Program, FirstTouch], None], cores: int) -> None:
    """``emit(program, touch)`` the instructions of ``program`` (its loads on ``cores`` cores) whose
    input loads ``touch`` charges their HBM fetches, each element's readers counted first
    (``count_readers``)."""
    emit(program, FirstTouch(tensors, count_readers(program, tensors, emit, cores)))


def gm_region(footprint: Footprint) -> Region:
    """The GM range ``footprint``'s elements lie in."""
    low, size = footprint.span
    return Region(GM, low, max(size, footprint.itemsize), footprint.tensor, footprint.offsets)


def gm_load(machine: Machine, core: int, footprint: Footprint, destination: Region) -> Instruction:
    """MTE2's load of ``footprint`` into ``destination`` (its HBM fetch charged by ``FirstTouch``)."""
    args = (("elements", int(footprint.offsets.size)), ("runs", footprint.runs))
    region = gm_region(footprint)
    return copy(machine, core, region, destination, moved=footprint.moved_bytes, args=args, data=footprint)
