"""The tensor-core model's clock: sectors a warp's reads touch, occupancy hiding latency, the cost of a
split depth's atomics, and the plans it picks on its figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import neoflow
from neoflow.ir.graph import Graph
from neoflow.targets.cuda.plan import MmaKernel, plan_op, simt_kernel
from neoflow.targets.cuda.timing import H100, predict_kernel, sectors_per_read

MODELS = Path(__file__).resolve().parents[3] / "models"


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


def test_beside_other_work_a_kernel_costs_its_share_of_the_sms_not_its_waves() -> None:
    import math

    from neoflow.targets.cuda.timing import mma_registers, resident_blocks

    kernel = _gemm_kernel()
    assert predict_kernel(kernel, beside=True) <= predict_kernel(kernel)
    resident = resident_blocks(kernel.block_threads, mma_registers(kernel), kernel.shared_bytes)
    blocks = math.prod(kernel.grid)
    # SMs for a wave and part of another: alone the grid takes two waves, beside other work the
    # part it fills, the rest of the second wave left to that work
    gpu = dataclasses.replace(H100, sms=math.ceil(blocks / (1.5 * resident)))
    fill = blocks / (resident * gpu.sms)
    assert 1 < fill < 2
    alone, beside = (predict_kernel(kernel, gpu, beside=b) - gpu.launch_seconds for b in (False, True))
    assert abs(alone / beside - 2 / fill) < 1e-6
    # never less than one block's own time: a grid of a block an SM costs that beside other work too
    one_block = dataclasses.replace(H100, sms=blocks)
    assert predict_kernel(kernel, one_block, beside=True) == predict_kernel(kernel, one_block)


def test_a_weight_gradient_beside_the_input_gradients_chain_is_planned_for_the_gpus_time() -> None:
    from neoflow.targets.cuda.concurrency import ops_beside_others
    from neoflow.targets.cuda.executor import graph_plans

    spec = neoflow.TrainSpec(labels="y", optimizer="sgd")
    compiled = neoflow.compile(MODELS / "capsule28.onnx", target="tensorcore", train=spec, fusion="neoflow")
    graph = compiled.executor_and_feed(compiled.example_batch(training=True), True)[0].graph
    # the second layer's weight update runs beside the input gradient's chain; the first layer's ends the step
    assert ops_beside_others(graph) == {"k2__next", "w_next", "b_next", "loss_value"}
    plans = {plan.op.name: plan for plan in graph_plans(graph, "tf32", "sm_90")}
    op = plans["k2__next"].op
    alone = plan_op(op, "k", "tf32", "sm_90", measured=False).kernels[0]
    beside = plans["k2__next"].kernels[0]
    assert beside.splits < alone.splits  # fewer, longer blocks: less split overhead on a shared GPU
    assert predict_kernel(beside, beside=True) < predict_kernel(alone, beside=True)
    first = plans["k1__next"]
    assert first.kernels == plan_op(first.op, first.kernels[0].name, "tf32", "sm_90").kernels
    single = Graph.from_ops([op])  # alone in its graph: nothing beside it
    assert not ops_beside_others(single)
