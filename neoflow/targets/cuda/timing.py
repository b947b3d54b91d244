"""The tensor-core model's clock: a kernel plan's predicted time on a GPU described as data.

A kernel's time is its launch latency plus the slowest of

* the tensor cores: the padded multiply-adds of its blocks, spread over the SMs in
  waves (``blocks / (SMs x blocks resident per SM)``, rounded up), at the MMA's rate
  per SM for its precision;
* the SIMT cores: a SIMT kernel's arithmetic at the FMA rate;
* shared-memory and L2 traffic: each block's operand tiles, gathered from L2;
* HBM: every tensor the kernel touches read once, its output written once.

Blocks resident per SM come from the registers, shared memory and threads a block
takes (the occupancy calculation); a GPU is a ``GpuFigures``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neoflow.fusion.work import op_work
from neoflow.targets.memory import nbytes


@dataclass(frozen=True)
class GpuFigures:
    """What the timing model needs of a GPU.  Defaults: NVIDIA H100 SXM5 (80 GB HBM3), from
    NVIDIA's H100 whitepaper (132 SMs, 1.83 GHz boost for dense tensor work; 989 TFLOP/s
    dense fp16/bf16 and 494 tf32 with ``wgmma``, of which ``mma.sync`` reaches about
    ``mma_sync_share``; 67 TFLOP/s fp32 FMA; 3.35 TB/s HBM3; 50 MB L2; 228 KB shared memory
    and 64 Ki registers per SM, at most 2048 threads and 32 blocks an SM) and a launch latency
    of a few microseconds (``cuLaunchKernel`` on an idle stream; a CUDA graph's kernels
    follow one another in about 1 µs)."""

    name: str = "H100 SXM5"
    sms: int = 132
    clock_hz: float = 1.83e9
    fp16_flops: float = 989e12
    tf32_flops: float = 494e12
    mma_sync_share: float = 0.62
    fp32_flops: float = 67e12
    hbm_bytes_per_s: float = 3.35e12
    l2_bytes_per_s: float = 10e12
    l2_bytes: int = 50 << 20
    shared_bytes_per_sm: int = 228 << 10
    shared_bytes_per_block: int = 227 << 10
    registers_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    launch_seconds: float = 4e-6
    graph_launch_seconds: float = 1.2e-6


H100 = GpuFigures()

#: registers a thread of an MMA kernel is assumed to hold besides its accumulators
MMA_BASE_REGISTERS = 64
DIRECT_BASE_REGISTERS = 40
#: cycles a block spends on each depth tile besides its multiply-adds (barrier, copy latency not hidden)
TILE_CYCLES = 300
#: registers a thread of a SIMT kernel is assumed to hold
SIMT_REGISTERS = 32


def resident_blocks(threads: int, registers: int, shared: int, gpu: GpuFigures = H100) -> int:
    """Blocks of ``threads`` threads, ``registers`` registers a thread and ``shared`` bytes an SM holds at once."""
    limits = [gpu.threads_per_sm // threads, gpu.blocks_per_sm, gpu.registers_per_sm // max(threads * registers, 1)]
    if shared:
        limits.append(gpu.shared_bytes_per_sm // shared)
    return max(0, min(limits))


def mma_registers(kernel) -> int:
    """Registers a thread of an ``MmaKernel`` holds: accumulators, prefetched operands (on the
    register path) and the rest (fitted to ptxas's counts: ~110 on the register path, ~70 with
    cp.async, for 32 accumulators)."""
    tiles = kernel.tiles
    accumulators = tiles.frags_m * tiles.frags_n * 4
    if kernel.direct:
        return min(255, DIRECT_BASE_REGISTERS + accumulators)
    prefetch = (tiles.block_m + tiles.block_n) * tiles.block_k // tiles.threads
    return min(255, MMA_BASE_REGISTERS + accumulators + prefetch // 2)


def _waves(blocks: int, resident: int, gpu: GpuFigures) -> float:
    return math.ceil(blocks / max(1, resident * gpu.sms))


def predict_kernel(kernel, gpu: GpuFigures = H100) -> float:
    """Predicted seconds of one ``MmaKernel`` or ``SimtKernel`` (launch included)."""
    from neoflow.targets.cuda.plan import MmaKernel

    if isinstance(kernel, MmaKernel):
        finish = 0.0
        if kernel.splits > 1:  # the finishing kernel reads the workspace and writes the output
            finish = gpu.graph_launch_seconds + kernel.finish_points * 8.0 / gpu.hbm_bytes_per_s
        return gpu.launch_seconds + _mma_seconds(kernel, gpu) + finish
    return gpu.launch_seconds + _simt_seconds(kernel, gpu)


def _mma_seconds(kernel, gpu: GpuFigures) -> float:
    tiles = kernel.tiles
    gx, gy, gz = kernel.grid
    blocks = gx * gy * gz
    resident = resident_blocks(tiles.threads, mma_registers(kernel), kernel.shared_bytes, gpu)
    if resident == 0:
        return math.inf
    peak = gpu.tf32_flops if kernel.precision == "tf32" else gpu.fp16_flops
    per_sm = peak * gpu.mma_sync_share / gpu.sms  # flop/s of one SM
    block_flops = 2.0 * tiles.block_m * tiles.block_n * kernel.split_tiles * tiles.block_k
    # a block shares its SM with the others resident; a wave ends when its slowest SM does
    waves = _waves(blocks, resident, gpu)
    per_wave = min(resident, math.ceil(blocks / gpu.sms)) * block_flops / per_sm
    # each depth tile costs a barrier and the wait for its copies: fewer, deeper tiles pay less
    per_wave += kernel.split_tiles * TILE_CYCLES / gpu.clock_hz
    compute = waves * per_wave
    # gathers: each block reads its operand tiles once per depth tile (4-byte elements), from L2
    gathered = blocks * kernel.split_tiles * (tiles.block_m + tiles.block_n) * tiles.block_k * 4.0
    l2 = gathered / gpu.l2_bytes_per_s
    hbm = _compulsory_bytes(kernel.view.op) / gpu.hbm_bytes_per_s
    # the operand gathers' index arithmetic and conversions: about 8 instructions an element
    issue = gathered / 4.0 * 8.0 / (gpu.fp32_flops / 2.0)
    return max(compute, l2, hbm, issue)


def _compulsory_bytes(op) -> float:
    """Bytes ``op`` moves at least: every input read once, its output written once."""
    return float(sum(nbytes(t) for t in (*op.inputs, op.output)))


def _simt_seconds(kernel, gpu: GpuFigures) -> float:
    op = kernel.op
    flops = max(op_work(op).flops, 1.0)
    blocks = kernel.grid[0]
    resident = resident_blocks(kernel.threads, SIMT_REGISTERS, 0, gpu)
    occupancy = min(1.0, blocks / (resident * gpu.sms))
    if not kernel.block_reduce and kernel.points < kernel.threads * gpu.sms:
        occupancy = kernel.points / (kernel.threads * gpu.sms * resident)  # a thread a point: few threads
    compute = flops / (gpu.fp32_flops / 2.0 * max(occupancy, 1.0 / gpu.sms))
    return max(compute, _compulsory_bytes(op) / gpu.hbm_bytes_per_s)
