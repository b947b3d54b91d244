"""Ops the GPU and model tests share: the capsule conv and its adjoints, a padded conv with a ReLU epilogue."""

from __future__ import annotations

import os

import numpy as np
import pytest

import neoflow
from neoflow.ir.op import Op
from neoflow.targets.cuda import nvrtc

#: tests that compile CUDA: skipped where NVRTC is missing, except in CI (``NEOFLOW_REQUIRE_NVRTC``
#: set by ``.ci/run``), where the test extras install it and a missing NVRTC is a failure
needs_nvrtc = pytest.mark.skipif(
    not nvrtc.available() and not os.environ.get("NEOFLOW_REQUIRE_NVRTC"),
    reason="NVRTC is not installed (pip install '.[cuda]')",
)


def gpu_reason() -> str | None:
    """Why the GPU tests cannot run here (None where a GPU answers)."""
    try:
        from neoflow.targets.cuda import driver

        driver.device()
    except Exception as err:
        return f"no GPU: {err}"
    return None


def capsule(stride: int, batch: int = 2, channels: int = 8, out: int = 5, dtype: str = "float32") -> Op:
    """A capsule convolution (3x3, 4x4 poses) with an ``out x out`` output."""
    size = (out - 1) * stride + 3
    return neoflow.op(
        f"Out[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, In[b, c, p*{stride} + r, q*{stride} + s, i, t] * "
        "W[k, c, r, s, t, j])",
        shapes={"In": (batch, channels, size, size, 4, 4), "W": (channels, channels, 3, 3, 4, 4)},
        dtype=dtype,
    )


def conv_relu() -> Op:
    """A padded 3x3 conv with bias and ReLU in its epilogue (N=2, C=K=24, 9x9)."""
    return neoflow.op(
        "Y[n, k, h, w] = max(ReduceAdd({c, r, s}, Select(h + r >= 1 && h + r <= 9 && w + s >= 1 && w + s <= 9, "
        "X[n, c, h + r - 1, w + s - 1], 0) * K[k, c, r, s]) + B[k], 0)",
        shapes={"X": (2, 24, 9, 9), "K": (24, 24, 3, 3), "B": (24,)},
        out_shape=(2, 24, 9, 9),
    )


def inputs_for(op: Op, seed: int = 0, round_to: str | None = None) -> dict[str, np.ndarray]:
    """Random inputs of ``op`` (rounded to float16 values when ``round_to`` is ``float16``, so
    products are exact in fp32 and only the order of the sums differs)."""
    rng = np.random.default_rng(seed)
    out = {}
    for tensor in op.inputs:
        value = rng.standard_normal(tensor.shape).astype(np.float32)
        if round_to == "float16":
            value = value.astype(np.float16).astype(np.float32)
        out[tensor.name] = value
    return out


def all_ops(op: Op) -> list[Op]:
    """``op`` and its adjoints."""
    return [op, *neoflow.grad(op).values()]


def masked_gradient(dtype: str = "float32") -> Op:
    """A weight gradient whose output gradient is masked by its ReLU: ``G * [A > 0]`` reads two
    tensors at the same point (one operand of the matrix product), its rows along memory."""
    return neoflow.op(
        "dW[k, c] = ReduceAdd({n}, G[n, k] * Select(A[n, k] > 0, 1, 0) * X[n, c])",
        shapes={"G": (480, 40), "A": (480, 40), "X": (480, 24)},
        dtype=dtype,
    )


def masked_input_gradient(dtype: str = "float32") -> Op:
    """An input gradient through a ReLU: the masked operand ``G * [A > 0]`` with its depth along
    memory (ragged rows and depth: 70 x 72)."""
    return neoflow.op(
        "dX[n, c] = ReduceAdd({k}, G[n, k] * Select(A[n, k] > 0, 1, 0) * W[k, c])",
        shapes={"G": (70, 72), "A": (70, 72), "W": (72, 40)},
        dtype=dtype,
    )


def long_sums() -> Op:
    """A sum long enough for a block per output point, under an epilogue: ``1 / Σ_k exp(A[i, k] x[k])``."""
    return neoflow.op("Y[i] = 1 / ReduceAdd({k}, exp(A[i, k] * X[k]))", shapes={"A": (48, 1500), "X": (1500,)})


def softmax_parts() -> Op:
    """A softmax whose row max is written twice (once inside its sum of exponentials, where it does
    not change from term to term) and a row sum read only where a ``Select`` takes it (the row
    before: out of bounds on the first row)."""
    return neoflow.op(
        "P[n, j] = exp(X[n, j] - ReduceMax({c}, X[n, c])) / ReduceAdd({d}, exp(X[n, d] - ReduceMax({e}, X[n, e])))"
        " + Select(n >= 1, ReduceAdd({f}, X[n - 1, f]), 0)",
        shapes={"X": (6, 10)},
    )


#: matrix products in 16-bit whose every operand layout a ``wgmma`` kernel meets (K-major and
#: MN-major A and B), ragged edges, depths of one, a few and many tiles, a batch
WGMMA_PRODUCTS = {
    "nn": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (70, 128), "B": (128, 72)}),
    "nt": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[j, k])", {"A": (64, 64), "B": (136, 64)}),
    "tn": ("C[i, j] = ReduceAdd({k}, A[k, i] * B[k, j])", {"A": (192, 72), "B": (192, 64)}),
    "tt": ("C[i, j] = ReduceAdd({k}, A[k, i] * B[j, k])", {"A": (64, 136), "B": (40, 64)}),
    "deep": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (64, 576), "B": (576, 64)}),
    "batch": ("C[b, i, j] = ReduceAdd({k}, A[b, i, k] * B[b, k, j])", {"A": (2, 64, 64), "B": (2, 64, 128)}),
}


def wgmma_plan(name: str, tiles, splits: int = 1):
    """The plan of ``WGMMA_PRODUCTS[name]`` as one ``wgmma`` kernel with ``tiles`` and ``splits``
    (forced: the planner would pick smaller tiles for such small products)."""
    import dataclasses

    from neoflow.codegen.hardware import TENSOR_CORE
    from neoflow.codegen.implicit_gemm import covers_output, gemm_views
    from neoflow.targets.cuda.plan import OpPlan, make_kernel

    text, shapes = WGMMA_PRODUCTS[name]
    op = neoflow.op(text, shapes=shapes, dtype="float16")
    (view,) = gemm_views(op, TENSOR_CORE)
    base = make_kernel(f"wg_{name}_{tiles.block_n}_{splits}", view, tiles, "fp16")
    kernel = dataclasses.replace(base, wgmma=True, splits=splits)
    assert kernel.wgmma_ready, f"{name} should be a wgmma kernel"
    return OpPlan(op, (kernel,), splits > 1 or not covers_output(op, [view]))
