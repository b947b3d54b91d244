"""The NPU targets (an Ascend-like AI core, as a model): ``npu`` (coupled cores) and ``npu-split``
(separate cube and vector cores).  The machine is data (``machine``); ops compile to typed
instruction streams (``compile``, ``cube``, ``vector``, ``isa``) with a static schedule
(``schedule``) that the simulator's replay proves (``replay``) and whose values it computes
(``simulate``); ``counters`` reports what a run did."""

from __future__ import annotations

from neoflow.fusion.cost import CostModel, Machine, Scheduled
from neoflow.targets.base import Target

#: share of the cube's peak the fusion planner assumes for a contraction the cube runs
CUBE_SHARE = 0.7


def _executor(preset):
    def build(graph, keep, groups=(), sliced=(), precision=None):
        from neoflow.targets.npu.executor import NpuExecutor

        return NpuExecutor(graph, keep, groups, sliced, precision, preset)

    return build


def npu_schedule(op) -> Scheduled:
    """How an op runs on the NPU, for the fusion cost model: a contraction whose operands the
    movers can copy on the cube, anything else on the vector unit."""
    from neoflow.codegen.hardware import NPU_CUBE
    from neoflow.codegen.implicit_gemm import gemm_views
    from neoflow.targets.npu.cube import cube_operands

    views = gemm_views(op, NPU_CUBE) if op.scatter is None else None
    if views and all(cube_operands(v) is not None for v in views):
        return Scheduled(fraction=CUBE_SHARE)
    return Scheduled(vector=True)


def _cost_model(preset):
    def build() -> CostModel:
        from neoflow.targets.npu.machine import machine

        npu = machine(preset)
        seconds_per_cycle = 1.0 / npu.clock_hz
        vector_flops = npu.vector_cores * npu.vector.repeat_bytes / 4 * npu.clock_hz
        figures = Machine(
            peak_flops=npu.peak_flops,
            loop_flops=vector_flops / 8,
            bandwidth=npu.memory.hbm_bytes_per_cycle * npu.clock_hz,
            call_seconds=500 * seconds_per_cycle,
            vector_flops=vector_flops,
            cache_bandwidth=npu.memory.l2_bytes_per_cycle * npu.clock_hz,
            cache_bytes=float(npu.memory.l2_bytes),
            measured=False,
            threads=npu.cube_cores,
            sliced_kernels=False,  # each op is its own programs: fusion inlines, it does not slice
        )
        return CostModel(figures, npu_schedule)

    return build


NPU = Target(
    "npu", "the NPU model (coupled Ascend-like cores): programs simulated", _executor("npu"), _cost_model("npu"), "npu"
)
NPU_SPLIT = Target(
    "npu-split",
    "the NPU model with separate cube and vector cores (Ascend A2-like)",
    _executor("npu-split"),
    _cost_model("npu-split"),
    "npu",
)


def machine_target(path: str) -> Target:
    """The NPU model of the machine described in the JSON file ``path`` (``Machine.to_dict``'s
    format, coupled or split as it says), read and checked now: ``target="npu:<path>"``."""
    from neoflow.targets.npu.machine import machine

    npu = machine(path)
    described = f"the NPU model of the machine in {path} ({npu.layout}, {npu.cube_cores} cube cores)"
    return Target(f"npu:{path}", described, _executor(npu), _cost_model(npu), "npu")
