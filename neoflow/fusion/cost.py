"""The fusion cost model: per kernel, arithmetic and bytes moved, turned into time by a roofline.

A kernel's ops are first fused (``plan.kernel_ops``: inlined producers
substituted), so recomputation shows up as extra arithmetic and a stored
intermediate as bytes written and read again.  Bytes are the compulsory
traffic to memory: every materialised output written once, every tensor read
from outside the kernel's registers read once (as much of it as is touched).
Time is ``max(flops / rate, bytes / bandwidth) + call overhead`` with the
machine's measured peak and bandwidth, where ``rate`` is the share of peak the
code generator's schedule reaches for that op (``schedule``, supplied by the
target: the blocked matmul kernel gets most of the peak, a plain loop nest
``Machine.loop_flops``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from neoflow.fusion.plan import FusionPlan, Kernel, kernel_ops
from neoflow.fusion.work import op_work
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op


@dataclass(frozen=True)
class Machine:
    """What the roofline needs: FMA peak and a plain loop's arithmetic rate
    (flop/s), memory bandwidth (bytes/s) and the fixed cost of one kernel call
    (s).  ``measured`` says whether the figures come from this machine."""

    peak_flops: float = 100e9
    loop_flops: float = 4e9
    bandwidth: float = 15e9
    call_seconds: float = 5e-6
    measured: bool = False


@dataclass(frozen=True)
class Cost:
    """Arithmetic, bytes moved and predicted seconds of a kernel (or a plan)."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)


ZERO = Cost(0.0, 0.0, 0.0)

#: ``schedule(op)``: the fraction of the FMA peak the target's code for ``op``
#: reaches, or None for a plain loop nest.
Schedule = Callable[[Op], float | None]


def _itemsize(dtype: str) -> int:
    return dt.numpy_dtype(dtype).itemsize


class CostModel:
    """Predicts kernel times for fusion policies (see the module docstring)."""

    def __init__(
        self, machine: Machine | Callable[[], Machine] | None = None, schedule: Schedule | None = None
    ) -> None:
        self._machine = machine or Machine()
        self.schedule = schedule
        self._ops: dict[Op, Cost] = {}
        self._kernels: dict[tuple, Cost] = {}

    @property
    def machine(self) -> Machine:
        """The machine's figures; a callable given for them is called on first
        use, so a policy that never asks for a cost never measures the machine."""
        if callable(self._machine):
            self._machine = self._machine()
        return self._machine

    def op_cost(self, op: Op) -> Cost:
        """The cost of one fused op."""
        cached = self._ops.get(op)
        if cached is not None:
            return cached
        work = op_work(op)
        moved = math.prod(op.shape) * _itemsize(op.dtype)
        for tensor in op.inputs:
            moved += min(work.reads.get(tensor.name, 0.0), tensor.size) * _itemsize(tensor.dtype)
        fraction = self.schedule(op) if self.schedule is not None else None
        rate = self.machine.loop_flops if fraction is None else self.machine.peak_flops * fraction
        seconds = max(work.flops / rate, moved / self.machine.bandwidth) + self.machine.call_seconds
        cost = Cost(work.flops, float(moved), seconds)
        self._ops[op] = cost
        return cost

    def kernel_cost(self, graph: Graph, kernel: Kernel) -> Cost:
        """Arithmetic, bytes and predicted seconds of ``kernel`` of ``graph``."""
        key = (kernel.ops, kernel.materialized)
        cached = self._kernels.get(key)
        if cached is None:
            cached = ZERO
            for op in kernel_ops(graph, kernel):
                cached = cached + self.op_cost(op)
            self._kernels[key] = cached
        return cached

    def plan_cost(self, graph: Graph, plan: FusionPlan) -> Cost:
        """The sum over the plan's kernels."""
        total = ZERO
        for kernel in plan.kernels:
            total = total + self.kernel_cost(graph, kernel)
        return total
