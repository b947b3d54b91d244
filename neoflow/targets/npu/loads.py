"""GM loads: what MTE2 moves from L2 and what it must first fetch from HBM.

A program's first read of a GM element misses L2 and comes from HBM, whose
bandwidth the cores loading at the time share; later reads of it (a
convolution's overlapping windows, an operand tile read once per output tile)
hit L2.  A load then takes the longer of its mover's time and its HBM bytes'
time at the program's share of HBM.  Each op's programs start with a cold L2 for
its inputs (an upper bound: a producer's output may still sit in L2); writes are
absorbed by L2.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from neoflow.targets.npu.data import Footprint
from neoflow.targets.npu.isa import Instruction, Region, copy
from neoflow.targets.npu.machine import GM, Machine


class FirstTouch:
    """Which elements of each GM input (name -> elements) a program has read so far."""

    def __init__(self, tensors: dict[str, int]) -> None:
        self.read = {name: np.zeros(size, bool) for name, size in tensors.items()}

    def new_bytes(self, footprint: Footprint) -> int:
        """Bytes of ``footprint`` not read before (marking them read); 0 for a tensor not tracked."""
        seen = self.read.get(footprint.tensor)
        if seen is None or footprint.offsets.size == 0:
            return 0
        fresh = int(np.count_nonzero(~seen[footprint.offsets]))
        seen[footprint.offsets] = True
        return fresh * footprint.itemsize


def gm_region(footprint: Footprint) -> Region:
    """The GM range ``footprint``'s elements lie in."""
    low, size = footprint.span
    return Region(GM, low, max(size, footprint.itemsize), footprint.tensor)


def gm_load(
    machine: Machine, core: int, footprint: Footprint, destination: Region, touch: FirstTouch, cores: int
) -> Instruction:
    """MTE2's load of ``footprint`` into ``destination``, with ``cores`` cores sharing HBM."""
    hbm = touch.new_bytes(footprint)
    args = (("elements", int(footprint.offsets.size)), ("runs", footprint.runs), ("hbm_bytes", hbm))
    load = copy(
        machine, core, gm_region(footprint), destination, moved=footprint.moved_bytes, args=args, data=footprint
    )
    share = machine.memory.hbm_bytes_per_cycle / max(1, cores)
    return dataclasses.replace(load, cycles=max(load.cycles, math.ceil(hbm / share)), hbm=hbm)
