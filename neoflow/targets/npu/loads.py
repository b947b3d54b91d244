"""GM loads: what MTE2 moves from L2 and what it must first fetch from HBM.

A program's first read of a GM element misses L2 and comes from HBM, whose
bandwidth the cores loading at the time share; later reads of it by the same
core (a convolution's overlapping windows, an operand tile read once per output
tile) hit L2.  Cores reading the same element (a weight every core multiplies
by) fetch it together, as their requests meet in L2: each pays its share of the
fetch.  A load then takes the longer of its mover's time and its HBM bytes' time
at the program's share of HBM.  The shares are known once the whole program is
(``FirstTouch.charge``).  Each op's programs start with a cold L2 for its inputs
(an upper bound: a producer's output may still sit in L2); writes are absorbed
by L2.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from neoflow.targets.npu.data import Footprint
from neoflow.targets.npu.isa import Instruction, Program, Region, copy
from neoflow.targets.npu.machine import GM, Machine


class FirstTouch:
    """The loads of a program's GM inputs (name -> elements), charged their HBM fetches once the
    program is complete (``charge``)."""

    def __init__(self, tensors: dict[str, int]) -> None:
        self.sizes = dict(tensors)
        self.loads: list[tuple[int, int, Footprint, int]] = []  # instruction, core, footprint, cores sharing HBM

    def add(self, program: Program, core: int, footprint: Footprint, load: Instruction, cores: int) -> int:
        """Append ``load`` (of ``footprint``, by ``core``, ``cores`` cores sharing HBM) to ``program``."""
        index = program.add(load)
        if footprint.tensor in self.sizes and footprint.offsets.size:
            self.loads.append((index, core, footprint, cores))
        return index

    def charge(self, program: Program) -> None:
        """Charge every recorded load of ``program`` its share of the HBM fetches: each element a
        core reads for the first time costs its bytes over the number of cores reading it; the
        shares are rounded so that they add up to the bytes of the elements read."""
        shares = np.zeros(len(self.loads))
        for tensor, size in self.sizes.items():
            mine = [k for k, (_, _, footprint, _) in enumerate(self.loads) if footprint.tensor == tensor]
            if not mine:
                continue
            readers = np.zeros(size, np.int64)
            firsts: list[tuple[np.ndarray, np.ndarray]] = []
            for core in sorted({self.loads[k][1] for k in mine}):
                loads = [k for k in mine if self.loads[k][1] == core]
                offsets = np.concatenate([self.loads[k][2].offsets for k in loads])
                owner = np.repeat(loads, [self.loads[k][2].offsets.size for k in loads])
                unique, first = np.unique(offsets, return_index=True)
                readers[unique] += 1
                firsts.append((unique, owner[first]))
            itemsize = self.loads[mine[0]][2].itemsize
            for unique, owners in firsts:
                np.add.at(shares, owners, itemsize / readers[unique])
        totals = np.rint(np.cumsum(shares)).astype(np.int64)
        for k, (index, _, _, cores) in enumerate(self.loads):
            hbm = int(totals[k] - (totals[k - 1] if k else 0))
            load = program.instructions[index]
            rate = program.machine.memory.hbm_bytes_per_cycle / max(1, cores)
            program.instructions[index] = dataclasses.replace(
                load, cycles=max(load.cycles, math.ceil(hbm / rate)), hbm=hbm, args=(*load.args, ("hbm_bytes", hbm))
            )


def gm_region(footprint: Footprint) -> Region:
    """The GM range ``footprint``'s elements lie in."""
    low, size = footprint.span
    return Region(GM, low, max(size, footprint.itemsize), footprint.tensor)


def gm_load(machine: Machine, core: int, footprint: Footprint, destination: Region) -> Instruction:
    """MTE2's load of ``footprint`` into ``destination`` (its HBM fetch charged by ``FirstTouch``)."""
    args = (("elements", int(footprint.offsets.size)), ("runs", footprint.runs))
    region = gm_region(footprint)
    return copy(machine, core, region, destination, moved=footprint.moved_bytes, args=args, data=footprint)
