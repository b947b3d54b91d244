"""The tensor-core model's clock: sectors a warp's reads touch, occupancy hiding latency, the cost of a
split depth's atomics, and the plans it picks on its figures."""

from __future__ import annotations

import dataclasses

import neoflow
from neoflow.targets.cuda.plan import MmaKernel, plan_op, simt_kernel
from neoflow.targets.cuda.timing import H100, predict_kernel, sectors_per_read


def _gemv(transposed: bool):
    read = "A[k, i]" if transposed else "A[i, k]"
    return neoflow.op(f"Y[i] = ReduceAdd({{k}}, {read} * X[k])", shapes={"A": (2048, 2048), "X": (2048,)})


def test_a_warp_reading_along_memory_touches_few_sectors() -> None:
    import numpy as np

    op = _gemv(False)
    lanes = {"i": np.zeros(32, dtype=np.int64), "k": np.arange(32)}  # a block per point: lanes take terms
    assert sectors_per_read(op, lanes) == {"A": 4, "X": 4}  # 32 floats in a row: four 32-byte sectors
    across = {"i": np.arange(32), "k": np.zeros(32, dtype=np.int64)}  # lanes take points
    assert sectors_per_read(op, across) == {"A": 32, "X": 1}  # a row apart each: a sector a lane


def test_scattered_reads_are_predicted_slower_than_reads_along_memory() -> None:
    along = simt_kernel("y", _gemv(False))
    scattered = simt_kernel("y", _gemv(True))
    assert along.block_reduce and scattered.block_reduce
    assert predict_kernel(scattered) > 2 * predict_kernel(along)


def _hgemm(size: int):
    shapes = {"A": (size, size), "B": (size, size)}
    return neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes=shapes, dtype="float16")


def _gemm_kernel() -> MmaKernel:
    op = _hgemm(2048)
    kernel = plan_op(op, "c", "fp16", "sm_80").kernels[0]  # mma.sync: a few blocks share an SM
    assert isinstance(kernel, MmaKernel)
    return kernel


def test_blocks_sharing_an_sm_hide_each_others_latency() -> None:
    kernel = _gemm_kernel()
    roomy = dataclasses.replace(H100, registers_per_sm=1 << 20, shared_bytes_per_sm=1 << 24)
    single = dataclasses.replace(H100, blocks_per_sm=1)
    assert predict_kernel(kernel, roomy) < predict_kernel(kernel, single)


def test_a_split_depth_pays_for_its_atomic_adds() -> None:
    kernel = dataclasses.replace(_gemm_kernel(), splits=4)
    slow_atomics = dataclasses.replace(H100, atomic_adds_per_s=H100.atomic_adds_per_s / 10)
    expected = 2048 * 2048 * 4 * 9 / H100.atomic_adds_per_s  # four splits of every output point, 10x slower
    assert abs(predict_kernel(kernel, slow_atomics) - predict_kernel(kernel) - expected) < 1e-3 * expected


def test_hgemm_keeps_two_blocks_an_sm_rather_than_deeper_tiles() -> None:
    # measured on an H100: 128x128x32 (two blocks an SM) 0.51 ms, 128x128x64 (one) 0.77 ms at 4096^3
    kernel = plan_op(_hgemm(4096), "c", "fp16", "sm_80").kernels[0]
    assert isinstance(kernel, MmaKernel) and kernel.direct
    assert kernel.tiles.block_k == 32 and kernel.splits == 1


def test_hgemm_on_hopper_takes_the_widest_wgmma_tile() -> None:
    # measured on an H100 at 4096^3: wgmma 128x256 0.253 ms (128x192 0.41, 128x128 0.47 before the
    # depth offsets were computed), mma.sync 128x128x32 0.50 ms
    kernel = plan_op(_hgemm(4096), "c", "fp16", "sm_90").kernels[0]
    assert isinstance(kernel, MmaKernel) and kernel.wgmma
    assert (kernel.tiles.block_m, kernel.tiles.block_n) == (128, 256) and kernel.splits == 1
    assert 0.2e-3 < predict_kernel(kernel) < 0.35e-3
