"""The tensor-core targets: ``cuda`` (CUDA C++ compiled by NVRTC, run through the driver API) and
``tensorcore`` (the same kernel plans executed by a numpy model that also predicts their time)."""

from __future__ import annotations

from neoflow.fusion.cost import CostModel, Machine
from neoflow.targets.base import Target
from neoflow.targets.cuda.plan import DEFAULT_PRECISION


def _cuda(graph, keep, groups=(), sliced=(), precision=DEFAULT_PRECISION):
    from neoflow.targets.cuda.executor import CudaExecutor

    return CudaExecutor(graph, keep, groups, sliced, precision)


def _model(graph, keep, groups=(), sliced=(), precision=DEFAULT_PRECISION):
    from neoflow.targets.cuda.executor import ModelExecutor

    return ModelExecutor(graph, keep, groups, sliced, precision)


def _cost_model() -> CostModel:
    """The fusion cost model with the GPU's figures (``timing.H100``): its tensor-core peak,
    HBM and L2 bandwidths and launch latency."""
    from neoflow.targets.cuda.timing import H100

    machine = Machine(
        peak_flops=H100.tf32_flops * H100.mma_sync_share,
        loop_flops=H100.fp32_flops / 4,
        bandwidth=H100.hbm_bytes_per_s,
        call_seconds=H100.graph_launch_seconds,
        vector_flops=H100.fp32_flops / 2,
        cache_bandwidth=H100.l2_bytes_per_s,
        cache_bytes=float(H100.l2_bytes),
        measured=False,
        threads=H100.sms,
    )
    return CostModel(machine)


CUDA = Target("cuda", "CUDA C++ for NVIDIA tensor cores (mma.sync), NVRTC + the driver API", _cuda, _cost_model)
TENSORCORE = Target(
    "tensorcore", "the tensor-core model: the cuda kernel plans run in numpy, with predicted times", _model, _cost_model
)
