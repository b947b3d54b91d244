"""The tensor-core targets: ``cuda`` (CUDA C++ compiled by NVRTC, run through the driver API) and
``tensorcore`` (the same kernel plans executed by a numpy model that also predicts their time)."""

from __future__ import annotations

from neoflow.fusion.cost import CostModel, Machine, Scheduled
from neoflow.targets.base import Target
from neoflow.targets.cuda.plan import DEFAULT_PRECISION


def _cuda(graph, keep, groups=(), sliced=(), precision=DEFAULT_PRECISION):
    from neoflow.targets.cuda.executor import CudaExecutor

    return CudaExecutor(graph, keep, groups, sliced, precision)


def _model(graph, keep, groups=(), sliced=(), precision=DEFAULT_PRECISION):
    from neoflow.targets.cuda.executor import ModelExecutor

    return ModelExecutor(graph, keep, groups, sliced, precision)


def gpu_schedule(op) -> Scheduled:
    """How the kernels of ``op`` run on the GPU, for the fusion cost model: a contraction on the
    tensor cores at the share of their peak the timing model predicts for its plan; any other op
    on the SIMT cores (vector rate)."""
    from neoflow.fusion.work import op_work
    from neoflow.targets.cuda.plan import MmaKernel, plan_op
    from neoflow.targets.cuda.timing import H100, predict_kernel

    kernels = plan_op(op, "probe", DEFAULT_PRECISION, measured=False).kernels  # a table never moves the plan
    if not all(isinstance(k, MmaKernel) for k in kernels):
        return Scheduled(vector=True)
    seconds = sum(predict_kernel(k) - H100.launch_seconds for k in kernels)
    peak = H100.tf32_flops * H100.mma_sync_share
    flops = max(op_work(op).flops, 1.0)
    return Scheduled(fraction=min(1.0, flops / max(seconds, 1e-12) / peak))


def _cost_model() -> CostModel:
    """The fusion cost model with the GPU's figures (``timing.H100``): its tensor-core peak,
    HBM and L2 bandwidths and launch latency, and each contraction's plan (``gpu_schedule``)."""
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
        # a softmax's row maximum and sum over a classifier's classes evaluated again in each reader, not
        # a small kernel each: capsule28's step 13 -> 11 kernels
        recomputed_terms=16,
    )
    return CostModel(machine, gpu_schedule)


CUDA = Target(
    "cuda", "CUDA C++ for NVIDIA tensor cores (mma.sync), NVRTC + the driver API", _cuda, _cost_model, "tensorcore"
)
TENSORCORE = Target(
    "tensorcore",
    "the tensor-core model: the cuda kernel plans run in numpy, with predicted times",
    _model,
    _cost_model,
    "tensorcore",
)
