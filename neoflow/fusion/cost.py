"""The fusion cost model: per kernel, arithmetic and bytes moved, turned into time by a roofline.

A kernel's ops are first fused (``plan.kernel_ops``: inlined producers
substituted), so recomputation shows up as extra arithmetic and a stored
intermediate as bytes written and read again.  Bytes are the compulsory
traffic to memory: every materialised output written once, every tensor read
from outside the kernel's registers read once (as much of it as is touched).
Time is ``max(flops / rate, bytes / bandwidth) + call overhead`` with the
machine's measured figures.  ``rate`` comes from the code generator's schedule
for the op (``schedule``, supplied by the target): the blocked matmul and chain
kernels reach a share of the FMA peak, a loop nest whose inner loop runs in
vector lanes ``Machine.vector_flops``, any other ``Machine.loop_flops``; a
chain kernel also says how much arithmetic it really does (its inner sum once
per point, not once per read).  ``bandwidth`` is the last-level cache's when
the kernel's bytes fit in it (the producer just wrote them there), else
memory's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from neoflow.fusion.inline import InlineMemo
from neoflow.fusion.plan import FusionPlan, Kernel, Nests, kernel_ops
from neoflow.fusion.slicing import slice_role
from neoflow.fusion.work import op_work
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op


@dataclass(frozen=True)
class Machine:
    """What the roofline needs: FMA peak, a plain loop's and a vectorised loop's
    arithmetic rates (flop/s), memory and last-level cache bandwidths (bytes/s),
    that cache's size (bytes) and the fixed cost of one kernel call (s), for
    ``threads`` threads.  ``measured`` says whether the figures come from this machine."""

    peak_flops: float = 100e9
    loop_flops: float = 4e9
    bandwidth: float = 15e9
    call_seconds: float = 5e-6
    vector_flops: float = 16e9
    cache_bandwidth: float = 60e9
    cache_bytes: float = 8e6
    measured: bool = False
    threads: int = 1
    #: whether the target runs a sliced kernel's ops slice by slice, intermediates in slice buffers
    #: (the planner proposes sliced kernels only where it does)
    sliced_kernels: bool = True
    #: a reduction of at most this many terms an output point the planner may recompute inside its
    #: readers, as it may a light op (0: none; a GPU, where each small kernel costs its launch)
    recomputed_terms: int = 0


@dataclass(frozen=True)
class Cost:
    """Arithmetic, bytes moved and predicted seconds of a kernel (or a plan)."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)


ZERO = Cost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Scheduled:
    """How the target's code runs an op: ``fraction`` of the FMA peak (blocked
    kernels; None for a loop nest), ``vector`` whether a loop nest's inner loop
    runs in vector lanes, ``flops`` the arithmetic it performs when that is not
    the expression's count (None: the same)."""

    fraction: float | None = None
    vector: bool = False
    flops: float | None = None


#: ``schedule(op)``: how the target's code for ``op`` runs.
Schedule = Callable[[Op], Scheduled]


def _itemsize(dtype: str) -> int:
    return dt.numpy_dtype(dtype).itemsize


class CostModel:
    """Predicts kernel times for fusion policies (see the module docstring).  ``target`` names the
    target a plan is made for and ``hardware`` is its hardware description (a
    ``codegen.hardware.Hardware``: intrinsics, memory scopes; None where the target has none), so a
    policy can plan per target; both are set by ``runtime.fusing.cost_model``."""

    def __init__(
        self,
        machine: Machine | Callable[[], Machine] | None = None,
        schedule: Schedule | None = None,
        nests: Nests | None = None,
        target: str = "",
        hardware: object | None = None,
    ) -> None:
        self._machine = machine or Machine()
        self.schedule = schedule
        self.nests = nests
        self.target = target
        self.hardware = hardware
        self._ops: dict[Op, Cost] = {}
        self._kernels: dict[Kernel, Cost] = {}
        # the substituted forms of the last graph's ops, by the inlined ops each reaches (``inline_all``'s
        # memo): the kernels a search prices share most of them
        self._inlined: tuple[Graph | None, InlineMemo] = (None, {})

    def __getstate__(self) -> dict:
        """Pickled (a compile cache keeps an executor's cost model) without its memoised costs."""
        return {**self.__dict__, "_ops": {}, "_kernels": {}, "_inlined": (None, {})}

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
        how = self.schedule(op) if self.schedule is not None else Scheduled()
        cost = self._roofline(work.flops if how.flops is None else how.flops, float(moved), how)
        self._ops[op] = cost
        return cost

    def nest_cost(self, ops: list[Op], buffered: Collection[str] = ()) -> Cost:
        """The cost of ``ops`` run as one loop nest: every output written once
        (the ``buffered`` ones not at all: they stay in tile buffers), every
        tensor from outside read once for all of them (as much of it as the most
        reading op touches), the ones' outputs that others read not read again."""
        produced = {op.name for op in ops}
        flops, moved, reads = 0.0, 0.0, {}
        inputs = {}
        for op in ops:
            work = op_work(op)
            flops += work.flops
            if op.name not in buffered:
                moved += math.prod(op.shape) * _itemsize(op.dtype)
            for tensor in op.inputs:
                if tensor.name not in produced:
                    inputs[tensor.name] = tensor
                    reads[tensor.name] = max(reads.get(tensor.name, 0.0), work.reads.get(tensor.name, 0.0))
        for name, tensor in inputs.items():
            moved += min(reads[name], tensor.size) * _itemsize(tensor.dtype)
        return self._roofline(flops, moved, Scheduled(vector=True))

    def sliced_cost(self, ops: list[Op], kernel: Kernel) -> Cost:
        """The cost of ``ops``, ``kernel``'s fused ops, run slice by slice: each op at
        its rate, moving only the tensors it reads from outside the kernel and its
        output where the kernel materialises it (the others stay in slice buffers),
        every tensor from outside counted once in the kernel's bytes; one call.
        With fewer slices than threads the threads left idle slow it in proportion."""
        produced = {op.name for op in ops}
        flops, seconds, moved, reads = 0.0, 0.0, 0.0, {}
        for op in ops:
            work = op_work(op)
            own = math.prod(op.shape) * _itemsize(op.dtype) if op.name in kernel.materialized else 0.0
            outside = {
                t.name: min(work.reads.get(t.name, 0.0), t.size) * _itemsize(t.dtype)
                for t in op.inputs
                if t.name not in produced
            }
            for name, count in outside.items():
                reads[name] = max(reads.get(name, 0.0), count)
            how = self.schedule(op) if self.schedule is not None else Scheduled()
            op_flops = work.flops if how.flops is None else how.flops
            op_bytes = own + sum(outside.values())
            seconds += self._roofline(op_flops, op_bytes, how).seconds - self.machine.call_seconds
            flops += op_flops
            moved += own
        moved += sum(reads.values())
        role = slice_role(ops[0])  # a valid sliced kernel's ops share one batch
        slices = role.batch // kernel.sliced if role is not None else 1
        threads = max(1, self.machine.threads)
        seconds *= threads / min(threads, slices)
        return Cost(flops, moved, seconds + self.machine.call_seconds)

    def _roofline(self, flops: float, moved: float, how: Scheduled) -> Cost:
        """``max(flops / rate, bytes / bandwidth) + call`` for a kernel the target runs as ``how``."""
        machine = self.machine
        if how.fraction is not None:
            rate = machine.peak_flops * how.fraction
        else:
            rate = machine.vector_flops if how.vector else machine.loop_flops
        bandwidth = machine.cache_bandwidth if moved <= machine.cache_bytes else machine.bandwidth
        seconds = max(flops / rate, moved / bandwidth) + machine.call_seconds
        return Cost(flops, moved, seconds)

    def kernel_cost(self, graph: Graph, kernel: Kernel) -> Cost:
        """Arithmetic, bytes and predicted seconds of ``kernel`` of ``graph``."""
        cached = self._kernels.get(kernel)
        if cached is None:
            if self._inlined[0] is not graph:
                self._inlined = (graph, {})
            ops = kernel_ops(graph, kernel, self._inlined[1])
            if kernel.sliced:
                cached = self.sliced_cost(ops, kernel)
            elif len(ops) > 1 and self.nests is not None and self.nests(ops, kernel.buffered) is not None:
                cached = self.nest_cost(ops, kernel.buffered)
            else:  # a buffered op where the target runs no loop nest is stored like any other
                cached = ZERO
                for op in ops:
                    cached = cached + self.op_cost(op)
            self._kernels[kernel] = cached
        return cached

    def plan_cost(self, graph: Graph, plan: FusionPlan) -> Cost:
        """The sum over the plan's kernels."""
        total = ZERO
        for kernel in plan.kernels:
            total = total + self.kernel_cost(graph, kernel)
        return total
