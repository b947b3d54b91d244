"""What the code generator's schedule for an op achieves, for the fusion cost model."""

from __future__ import annotations

import math

from neoflow.codegen.gemm import MR, NR, gemm_plan, kernel_cycles
from neoflow.ir.op import Op

#: Multiply-adds per cycle of one core at the micro-kernel's peak (MR x NR per 6 cycles).
MACS_PER_CYCLE = MR * NR / 6


def peak_fraction(op: Op) -> float | None:
    """The fraction of the FMA peak the blocked kernel reaches on ``op`` by its
    cycle model (padding, packing and write-back included), or None when ``op``
    runs as a plain loop nest."""
    plan = gemm_plan(op)
    if plan is None:
        return None
    cycles = macs = 0.0
    for piece, mapping in plan.pieces:
        if mapping is None:
            continue
        cycles += kernel_cycles(mapping, piece.op.extent)
        macs += math.prod(piece.op.extent.values())
    return min(1.0, macs / MACS_PER_CYCLE / cycles) if cycles else None
