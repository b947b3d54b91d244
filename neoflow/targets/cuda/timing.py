"""The tensor-core model's clock: a kernel plan's predicted time on a GPU described as data.

A kernel's time is its launch latency plus the slowest of

* an MMA kernel's blocks, spread over the SMs in waves (``blocks / (SMs x blocks
  resident per SM)``, rounded up), each costing per depth tile the SM cycles of its
  warps' MMA instructions, of their operand copies (``cp.async``, a vector each) or
  register gathers, and a barrier with the copies' latency not hidden;
* a SIMT kernel's memory traffic, in the 32-byte sectors its warps' reads touch (a
  warp's 32 lanes read neighbouring points, or for a block per output point
  neighbouring terms of its sum: scattered reads cost a sector a lane), and its
  instructions;
* L2 traffic: each MMA block's operand tiles, gathered from L2;
* HBM: every tensor the kernel touches read once, its output written once.

Blocks resident per SM come from the registers, shared memory and threads a block
takes (the occupancy calculation); a GPU is a ``GpuFigures``.  The cycle costs per
instruction are measured, not derived: fitted to the per-kernel times of
``benchmarks/gpu_results.md`` on an H100 (MMA instructions issue at about the same rate
in tf32 and fp16 once the tf32 fragments' rounding and element loads are counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from neoflow.fusion.work import op_work
from neoflow.ir import index
from neoflow.ir.dtypes import numpy_dtype
from neoflow.ir.expr import Read
from neoflow.ir.simplify import read_offset
from neoflow.targets.memory import nbytes


@dataclass(frozen=True)
class GpuFigures:
    """What the timing model needs of a GPU.  Defaults: NVIDIA H100 SXM5 (80 GB HBM3), from
    NVIDIA's H100 whitepaper (132 SMs, 1.83 GHz boost for dense tensor work; 989 TFLOP/s
    dense fp16/bf16 and 494 tf32 with ``wgmma``, of which ``mma.sync`` reaches about
    ``mma_sync_share`` and neoflow's warp-specialised ``wgmma`` kernels ``wgmma_share`` (fitted:
    hgemm 4096^3 and 8192^3 ran at 544-554 TFLOP/s in ``benchmarks/gpu_results.md``); 67 TFLOP/s
    fp32 FMA; 3.35 TB/s HBM3; 50 MB L2; 228 KB shared memory and 64 Ki registers per SM, at most
    2048 threads and 32 blocks an SM), float32 atomic adds in L2 at the rate the split-depth
    kernels of ``benchmarks/gpu_results.md`` imply, and a launch latency of a few microseconds
    (``cuLaunchKernel`` on an idle stream; a CUDA graph's kernels follow one another in about 1 µs)."""

    name: str = "H100 SXM5"
    sms: int = 132
    clock_hz: float = 1.83e9
    fp16_flops: float = 989e12
    tf32_flops: float = 494e12
    mma_sync_share: float = 0.62
    wgmma_share: float = 0.56
    fp32_flops: float = 67e12
    hbm_bytes_per_s: float = 3.35e12
    l2_bytes_per_s: float = 10e12
    l2_bytes: int = 50 << 20
    shared_bytes_per_sm: int = 228 << 10
    shared_bytes_per_block: int = 227 << 10
    registers_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    atomic_adds_per_s: float = 3e11
    launch_seconds: float = 4e-6
    graph_launch_seconds: float = 1.2e-6


H100 = GpuFigures()

#: registers a thread of an MMA kernel is assumed to hold besides its accumulators
MMA_BASE_REGISTERS = 64
DIRECT_BASE_REGISTERS = 40
#: SM cycles per warp-wide MMA instruction with its fragment loads (m16n8k16 for 16-bit operands;
#: m16n8k8 for tf32, whose fragments are rounded and partly loaded element by element), and per operand
#: copy below: fitted to 462 kernels timed alone on an H100 (every tile and split the plans may take for
#: the capsule conv's forward and adjoint pieces, stride 1 and 2, fp16 and tf32): Spearman 0.94 between
#: predicted and measured, the log of their ratio 0.23 (rms), and the kernels chosen within 2 % of the
#: fastest measured, on average
MMA_CYCLES = {"fp16": 2.0, "bf16": 2.0, "tf32": 5.0}
#: SM cycles per warp-wide operand copy (``cp.async`` of a vector a thread, its table entries and guard) ...
COPY_CYCLES = 8.0
#: ... and per warp-wide element of the register path (gathered, converted, stored to shared memory)
GATHER_CYCLES = 30.0
#: SM cycles per warp-wide operand copy of a ``wgmma`` kernel's producer warpgroup, which copies while
#: the tensor cores multiply (``wgmma`` is asynchronous): measured on an H100 at hgemm 4096^3, its copies
#: alone took 0.333 ms reading a depth-table entry each (25 cycles a copy), and computing the depth
#: offsets instead the whole kernel took 0.253 ms, its multiplies alone 0.219 (19 cycles a copy at most)
WGMMA_COPY_CYCLES, WGMMA_TABLE_COPY_CYCLES = 19.0, 25.0
#: cycles a block waits on each depth tile besides its instructions (barrier, copy latency), hidden by
#: the other blocks resident on its SM
TILE_CYCLES = 200
#: registers a thread of a SIMT kernel is assumed to hold
SIMT_REGISTERS = 32
#: warp instructions of a SIMT kernel per element read (address arithmetic, guard, load)
SIMT_READ_INSTRUCTIONS = 4
#: bytes of the memory sectors warps' loads are served in
SECTOR_BYTES = 32


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


def predict_kernel(kernel, gpu: GpuFigures = H100, beside: bool = False) -> float:
    """Predicted seconds of one ``MmaKernel`` or ``SimtKernel`` (launch included).  ``beside``: of the
    GPU's time an ``mma.sync`` kernel takes while other work runs beside it (``_mma_seconds``)."""
    from neoflow.targets.cuda.plan import MmaKernel

    if isinstance(kernel, MmaKernel):
        finish = 0.0
        if kernel.splits > 1:  # the finishing kernel reads the workspace and writes the output
            finish = gpu.graph_launch_seconds + kernel.finish_points * 8.0 / gpu.hbm_bytes_per_s
        return gpu.launch_seconds + _mma_seconds(kernel, gpu, beside) + finish
    return gpu.launch_seconds + _simt_seconds(kernel, gpu)


def _mma_seconds(kernel, gpu: GpuFigures, beside: bool = False) -> float:
    """An MMA kernel's blocks in waves (alone on the GPU), or ``beside`` other work: its blocks'
    share of every SM's places (a wave it fills only in part leaves the rest to the work beside
    it), but no less than one block's own time, instructions and latency."""
    tiles = kernel.tiles
    gx, gy, gz = kernel.grid
    blocks = gx * gy * gz
    resident = resident_blocks(kernel.block_threads, mma_registers(kernel), kernel.shared_bytes, gpu)
    if resident == 0:
        return math.inf
    m, n, k = kernel.mma_shape
    mmas = tiles.block_m * tiles.block_n * tiles.block_k / (m * n * k)
    # a combined operand copies a tile of each of its tensors
    rows = {"a": tiles.block_m * kernel.copies("a"), "b": tiles.block_n * kernel.copies("b")}
    loads = tiles.block_k * (rows["a"] / kernel.vector("a") + rows["b"] / kernel.vector("b")) / 32
    if kernel.wgmma:
        # the tensor cores at the rate these kernels reach, beside the producer's copies; it runs stages
        # ahead, so a tile's latency is paid once, filling the pipeline
        rate = gpu.fp16_flops * gpu.wgmma_share / (gpu.sms * gpu.clock_hz)
        computed = all(kernel.depth_stride(side) is not None for side in ("a", "b"))
        copy = WGMMA_COPY_CYCLES if computed else WGMMA_TABLE_COPY_CYCLES
        tile_cycles = max(2.0 * tiles.block_m * tiles.block_n * tiles.block_k / rate, loads * copy)
        per_wave = (kernel.split_tiles * tile_cycles + kernel.stages * TILE_CYCLES) / gpu.clock_hz
        compute = _waves(blocks, resident, gpu) * per_wave
    else:
        per_load = COPY_CYCLES if kernel.direct else GATHER_CYCLES
        tile_cycles = mmas * MMA_CYCLES[kernel.precision] + loads * per_load
        # the blocks resident on an SM share its issue slots, and hide one another's latency: a wave lasts
        # as long as their instructions or one block's instructions and latency, whichever is longer
        if beside:
            share = blocks / (resident * gpu.sms) * max(resident * tile_cycles, tile_cycles + TILE_CYCLES)
            compute = kernel.split_tiles * max(share, tile_cycles + TILE_CYCLES) / gpu.clock_hz
        else:
            sharing = min(resident, math.ceil(blocks / gpu.sms))
            per_wave = kernel.split_tiles * max(sharing * tile_cycles, tile_cycles + TILE_CYCLES) / gpu.clock_hz
            compute = _waves(blocks, resident, gpu) * per_wave
    if kernel.splits > 1:  # each block adds its tile into the workspace, atomically
        compute += blocks * tiles.block_m * tiles.block_n / gpu.atomic_adds_per_s
    # gathers: each block reads its operand tiles once per depth tile, from L2 (4-byte elements as fitted to
    # the mma.sync kernels; a wgmma kernel's 16-bit copies move 2: its hgemm moved 6.4 TB/s unhindered)
    element = float(kernel.element_bytes) if kernel.wgmma else 4.0
    gathered = blocks * kernel.split_tiles * (rows["a"] + rows["b"]) * tiles.block_k * element
    if kernel.splits > 1:  # each block adds its tile into the workspace: an atomic read-modify-write in L2
        gathered += blocks * tiles.block_m * tiles.block_n * 8.0
    l2 = gathered / gpu.l2_bytes_per_s
    hbm = _compulsory_bytes(kernel.view.op) / gpu.hbm_bytes_per_s
    return max(compute, l2, hbm)


def _compulsory_bytes(op) -> float:
    """Bytes ``op`` moves at least: every input read once, its output written once."""
    return float(sum(nbytes(t) for t in (*op.inputs, op.output)))


def _lanes(variables: list[tuple[str, int]]) -> dict[str, np.ndarray]:
    """The values of ``variables`` (row-major, the last fastest) at the first 32 points of their box."""
    rest, values = np.arange(32, dtype=np.int64) % max(math.prod(e for _, e in variables), 1), {}
    for name, extent in reversed(variables):
        values[name], rest = rest % extent, rest // extent
    return values


def sectors_per_read(op, lanes: dict[str, np.ndarray]) -> dict[str, int]:
    """Per input tensor of ``op``: the memory sectors one warp-wide read of it touches, its 32 lanes
    at the points ``lanes`` gives (any other variable 0)."""
    tensors = {t.name: t for t in op.inputs}
    sectors: dict[str, int] = {}
    for read in (node for node in op.body.walk() if isinstance(node, Read)):
        tensor = tensors.get(read.tensor)
        if tensor is None or read.tensor in sectors:
            continue
        offset = read_offset(read.indices, tensor.shape, op.extent)
        env = {str(v): lanes.get(str(v), np.zeros(32, dtype=np.int64)) for v in offset.free_symbols}
        elements = np.broadcast_to(np.asarray(index.evaluate(offset, env), dtype=np.int64), (32,))
        sectors[read.tensor] = len(np.unique(elements * numpy_dtype(tensor.dtype).itemsize // SECTOR_BYTES))
    return sectors


def _simt_seconds(kernel, gpu: GpuFigures) -> float:
    """A SIMT kernel's reads in sectors (``sectors_per_read``: a warp is 32 neighbouring points, or
    with ``block_reduce`` 32 neighbouring terms of one point's sum) from L2, its instructions at
    half the issue rate, and its compulsory HBM traffic."""
    from neoflow.targets.cuda.plan import reduction_parts

    op = kernel.op
    work = op_work(op)
    lanes = _lanes([(v, op.extent[v]) for v in op.indices])
    if kernel.block_reduce:
        reduce = reduction_parts(op)[0]
        lanes = {v: np.zeros(32, dtype=np.int64) for v in op.indices} | _lanes([(a, op.extent[a]) for a in reduce.axes])
    sectors = sum(work.reads.get(name, 0.0) / 32 * count for name, count in sectors_per_read(op, lanes).items())
    instructions = (sum(work.reads.values()) * SIMT_READ_INSTRUCTIONS + max(work.flops, 1.0)) / 32
    issue = instructions / (gpu.sms * 4 * gpu.clock_hz / 2)
    blocks = kernel.grid[0]
    resident = resident_blocks(kernel.threads, SIMT_REGISTERS, 0, gpu)
    occupancy = min(1.0, blocks / (resident * gpu.sms))
    if not kernel.block_reduce and kernel.points < kernel.threads * gpu.sms:
        occupancy = kernel.points / (kernel.threads * gpu.sms * resident)  # a thread a point: few threads
    compute = max(work.flops, 1.0) / (gpu.fp32_flops / 2.0 * max(occupancy, 1.0 / gpu.sms))
    memory = sectors * SECTOR_BYTES / gpu.l2_bytes_per_s
    return max(compute, issue, memory, _compulsory_bytes(op) / gpu.hbm_bytes_per_s)
