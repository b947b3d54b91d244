"""The cpu target: C with AVX2/FMA (AVX-512 where present) and OpenMP, compiled by the system cc, loaded with ctypes."""

from __future__ import annotations

from neoflow.fusion.cost import CostModel
from neoflow.targets.base import Target, exact_only


def _executor(graph, keep, groups=(), sliced=(), precision=None):
    from neoflow.targets.cpu.executor import CpuExecutor

    exact_only("cpu", precision)
    return CpuExecutor(graph, keep, groups, sliced)


def _cost_model() -> CostModel:
    """This machine's measured figures and the C code generator's schedule for each op."""
    from neoflow.targets.cpu.estimate import schedule
    from neoflow.targets.cpu.nest import nest_buffers

    return CostModel(_measured_machine, schedule, nest_buffers)


def _measured_machine():
    """This machine's figures at the threads kernels run with (measured once, then cached on disk)."""
    from neoflow.targets.cpu.executor import threads
    from neoflow.targets.cpu.machine import measure_machine

    return measure_machine(threads())


TARGET = Target("cpu", "C + OpenMP for this CPU (AVX2/FMA, AVX-512 where present)", _executor, _cost_model, "cpu")
