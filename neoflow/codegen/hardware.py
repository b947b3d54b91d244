"""Hardware as data: intrinsics written as tensor expressions, memory scopes with capacities.

A target is its intrinsics (what one instruction, or one tight group of
instructions, computes, as a TE with fixed extents), its memory scopes and its
vector width.  The intrinsic mapper (``neoflow.codegen.mapping``) matches an
op's iteration space onto an intrinsic's using nothing else, so the same
mapper serves the CPU, the tensor-core model and the NPU model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from neoflow.ir.op import Op
from neoflow.ir.text import parse_op


@dataclass(frozen=True)
class Intrinsic:
    """One compute intrinsic: ``expression`` in the text language over tensors
    ``c`` (accumulated) and ``a``, ``b``, with ``sizes`` for its axes, operand
    and accumulator dtypes, and the cycles one call takes on its unit."""

    name: str
    expression: str
    sizes: tuple[tuple[str, int], ...]
    input_dtype: str = "float32"
    accumulator_dtype: str = "float32"
    cycles: float = 1.0

    @cached_property
    def op(self) -> Op:
        """The intrinsic as an op (extents from ``sizes``)."""
        sizes = dict(self.sizes)
        shapes = {}
        for name, dims in (("a", self._dims("a")), ("b", self._dims("b"))):
            shapes[name] = tuple(sizes[d] for d in dims)
        return parse_op(self.expression, shapes=shapes, dtype=self.input_dtype)

    def _dims(self, tensor: str) -> list[str]:
        text = self.expression.split("+=", 1)[1]
        start = text.index(f"{tensor}[") + 2
        inside = text[start : text.index("]", start)]
        return [d.strip() for d in inside.split(",") if d.strip()]

    @cached_property
    def axes(self) -> tuple[str, ...]:
        """The intrinsic's axes: output axes, then reduction axes."""
        return tuple(name for name, _ in self.sizes)

    @cached_property
    def roles(self) -> dict[str, frozenset[str]]:
        """For each axis, which of ``c``, ``a``, ``b`` it indexes (the access matrix)."""
        roles: dict[str, set[str]] = {axis: set() for axis in self.axes}
        for axis in self.op.indices:
            roles[axis].add("c")
        for read in self.op.body.reads():
            for expr in read.indices:
                for symbol in expr.free_symbols:
                    roles[symbol.name].add(read.tensor)
        return {axis: frozenset(r) for axis, r in roles.items()}

    @property
    def flops(self) -> int:
        """Multiply-adds of one call, counted as two flops each."""
        total = 2
        for _, size in self.sizes:
            total *= size
        return total


@dataclass(frozen=True)
class MemoryScope:
    """A level of the memory hierarchy: capacity and bandwidth to the level below it."""

    name: str
    capacity: int  # bytes
    bandwidth: float  # bytes per cycle


@dataclass(frozen=True)
class Hardware:
    """A target: its intrinsics, memory scopes (innermost first), vector width and registers."""

    name: str
    intrinsics: tuple[Intrinsic, ...]
    scopes: tuple[MemoryScope, ...]
    vector_bytes: int
    registers: int
    loads_per_cycle: float = 2.0  # operand-tile loads (a vector, a broadcast or a matrix fragment) per cycle
    cores: int = 1
    notes: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def scope(self, name: str) -> MemoryScope:
        """The memory scope called ``name``."""
        for item in self.scopes:
            if item.name == name:
                return item
        raise KeyError(f"{self.name} has no memory scope '{name}' ({', '.join(s.name for s in self.scopes)})")

    def intrinsic(self, name: str) -> Intrinsic:
        """The intrinsic called ``name``."""
        for item in self.intrinsics:
            if item.name == name:
                return item
        raise KeyError(f"{self.name} has no intrinsic '{name}' ({', '.join(i.name for i in self.intrinsics)})")


def _cpu_caches() -> dict[int, int]:
    """Data cache sizes by level, read from sysfs (Linux), else common defaults."""
    sizes = {1: 32 << 10, 2: 512 << 10, 3: 8 << 20}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for entry in root.glob("index*"):
        try:
            kind = (entry / "type").read_text().strip()
            level = int((entry / "level").read_text())
            text = (entry / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes[level] = int(text.rstrip("KMG")) * scale
    return sizes


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in ``/proc/cpuinfo`` (Linux); None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field):
            return line.partition(":")[2].strip()
    return None


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``, Linux); empty where they cannot be read."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``, Linux; else what ``platform`` says)."""
    import platform

    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _cpu(name: str, vector_bytes: int, notes: str, step_cycles: float = 6.0) -> Hardware:
    lanes = vector_bytes // 4
    caches = _cpu_caches()
    # register blocking: 6 rows x 2 vectors of accumulators (12 registers) + 2 for b + 1 broadcast <= 16;
    # one depth step of it is 96 multiply-adds: 6 cycles on two 8-lane FMA ports, 3 on two 16-lane ones
    outer = (("i", 6), ("j", 2 * lanes), ("k", 1))
    intrinsics = (
        Intrinsic("fma", "c[i] += a[i] * b[]", (("i", lanes),), cycles=0.5),
        Intrinsic("outer_product", "c[i, j] += a[i, k] * b[k, j]", outer, cycles=step_cycles),
        Intrinsic("dot", "c[] += a[k] * b[k]", (("k", lanes),), cycles=0.5),
    )
    scopes = (
        MemoryScope("registers", 16 * vector_bytes, 3 * vector_bytes),
        MemoryScope("L1", caches[1], 2 * vector_bytes),
        MemoryScope("L2", caches[2], vector_bytes),
        MemoryScope("L3", caches.get(3, 8 << 20), vector_bytes / 2),
        MemoryScope("DRAM", 1 << 40, 8.0),
    )
    return Hardware(name, intrinsics, scopes, vector_bytes, 16, 2.0, os.cpu_count() or 1, notes)


#: Whether this machine has AVX-512 (the kernels are built for it, ``-march=native``).
AVX512 = "avx512f" in cpu_flags()
#: The cpu target.  Its kernels are built for the machine they run on (``-march=native``): where
#: that has AVX-512, the 6 x 16 micro-kernel keeps a row in one zmm register and a depth step
#: takes half the cycles (``targets/cpu/gemm.py``); the rest of the code is AVX2's.
AVX2 = _cpu(
    "avx2",
    32,
    "x86-64 AVX2 + FMA: 16 ymm registers of 8 floats, two FMA ports (the micro-kernel in zmm with AVX-512)",
    step_cycles=3.0 if AVX512 else 6.0,
)
PORTABLE = _cpu("portable", 32, "GCC vector extensions (8 x float), for CPUs without AVX2")


def _matrix_unit(name: str, cycles: float) -> Intrinsic:
    """A 16x16x16 matrix multiply-accumulate unit, fp16 in and fp32 accumulate."""
    return Intrinsic(
        name,
        "c[i, j] += a[i, k] * b[k, j]",
        (("i", 16), ("j", 16), ("k", 16)),
        input_dtype="float16",
        accumulator_dtype="float32",
        cycles=cycles,
    )


TENSOR_CORE = Hardware(
    "tensorcore",
    (_matrix_unit("mma_16x16x16", cycles=8.0),),
    (
        MemoryScope("fragment", 256 << 10, 1024.0),
        MemoryScope("shared", 228 << 10, 128.0),
        MemoryScope("L2", 50 << 20, 64.0),
        MemoryScope("global", 80 << 30, 32.0),
    ),
    vector_bytes=16,
    registers=255,
    loads_per_cycle=2.0,
    cores=132,
    notes="a tensor-core GPU model: MMA 16x16x16, fp16 in, fp32 accumulate",
)

NPU_CUBE = Hardware(
    "npu",
    (_matrix_unit("cube_16x16x16", cycles=1.0),),
    (
        MemoryScope("L0A", 64 << 10, 512.0),
        MemoryScope("L0B", 64 << 10, 512.0),
        MemoryScope("L0C", 256 << 10, 256.0),
        MemoryScope("UB", 256 << 10, 128.0),
        MemoryScope("L1", 1 << 20, 128.0),
        MemoryScope("global", 32 << 30, 32.0),
    ),
    vector_bytes=32,
    registers=0,
    loads_per_cycle=2.0,
    notes="an Ascend-like AI core: cube unit 16x16x16 fp16 -> fp32, vector unit, L1/L0A/L0B/L0C/UB buffers",
)

TARGETS = {"cpu": AVX2, "avx2": AVX2, "portable": PORTABLE, "tensorcore": TENSOR_CORE, "npu": NPU_CUBE}


def hardware(target: str | Hardware) -> Hardware:
    """The hardware description of ``target`` (a name in ``TARGETS`` or a ``Hardware``)."""
    if isinstance(target, Hardware):
        return target
    if target not in TARGETS:
        raise KeyError(f"unknown hardware '{target}' (known: {', '.join(TARGETS)})")
    return TARGETS[target]
