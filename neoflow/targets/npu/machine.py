"""The NPU as data: an Ascend-like AI core's compute units, buffers, data movers and memory system.

A ``Machine`` is everything the NPU compiler, its static scheduler and its
simulator know of the hardware; nothing about the NPU is a constant in their
code.  Two presets share the format (``PRESETS``): ``npu`` — coupled, cube and
vector units in one core (Ascend 910-like, 32 cores) — and ``npu-split`` —
separated cube cores and vector cores that meet through GM and L2 (Ascend 910B /
Atlas A2-like, one cube core to two vector cores).  ``machine(spec)`` takes a
preset's name, a JSON file of the same format (``Machine.to_dict``), a mapping,
or a ``Machine``; every field is checked, an error naming the field.

Every number carries its source in ``SOURCES`` (printed by ``describe``): a
public document, or a stated model assumption and the reasoning behind it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from neoflow.errors import CompileError

#: the kinds of core a buffer, a unit or a mover belongs to: ``core`` on a coupled machine (both units),
#: ``cube`` or ``vector`` on a split one
CORE_KINDS = ("core", "cube", "vector")
LAYOUTS = ("coupled", "split")
#: places data lives in: the per-core buffers and the chip's global memory
GM = "GM"
#: the data movers, each a pipe of a core (a split machine's cube and vector cores each have an MTE2)
MOVERS = ("MTE2", "MTE1", "FIXPIPE", "MTE3")


@dataclass(frozen=True)
class Buffer:
    """An on-core buffer: ``capacity`` bytes, addresses aligned to ``alignment`` bytes, ``banks``
    banks of ``bank_bytes`` bytes interleaved (two accesses to one bank in a cycle conflict), on
    cores of kind ``on``."""

    name: str
    capacity: int
    alignment: int
    banks: int
    bank_bytes: int
    on: str


@dataclass(frozen=True)
class Mover:
    """A data mover (a pipe of its own): the ``paths`` ``(source, destination)`` it serves, moving
    ``bytes_per_cycle`` after ``latency`` cycles, in whole ``burst`` bytes; on cores of kind ``on``."""

    name: str
    paths: tuple[tuple[str, str], ...]
    bytes_per_cycle: float
    latency: int
    burst: int
    on: str


@dataclass(frozen=True)
class Cube:
    """The matrix unit: ``m x n x k`` multiply-adds a cycle, ``input_dtype`` operands from L0A/L0B
    (in ``m x k`` and ``k x n`` fractals), ``accumulator_dtype`` sums in L0C."""

    m: int = 16
    n: int = 16
    k: int = 16
    input_dtype: str = "float16"
    accumulator_dtype: str = "float32"
    latency: int = 8

    @property
    def macs_per_cycle(self) -> int:
        return self.m * self.n * self.k


@dataclass(frozen=True)
class Vector:
    """The SIMD unit: one repeat of ``repeat_bytes`` bytes of UB operands a cycle, after ``latency``."""

    repeat_bytes: int = 256
    latency: int = 4


@dataclass(frozen=True)
class MemorySystem:
    """What lies outside the cores: an L2 of ``l2_bytes`` serving ``l2_bytes_per_cycle`` (all cores
    together) and HBM serving ``hbm_bytes_per_cycle``; a miss in L2 adds ``hbm_latency`` cycles."""

    l2_bytes: int
    l2_bytes_per_cycle: float
    hbm_bytes: int
    hbm_bytes_per_cycle: float
    hbm_latency: int


@dataclass(frozen=True)
class Machine:
    """An NPU: ``cube_cores`` cores with a cube unit and ``vector_cores`` with a vector unit — the
    same cores on a ``coupled`` machine (then the two counts are equal), separate ones on a
    ``split`` machine — clocked at ``clock_hz``, with their buffers, movers and memory system."""

    name: str
    layout: str
    clock_hz: float
    cube_cores: int
    vector_cores: int
    cube: Cube
    vector: Vector
    buffers: tuple[Buffer, ...]
    movers: tuple[Mover, ...]
    memory: MemorySystem
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def peak_flops(self) -> float:
        """The cubes' peak rate, flop/s (a multiply-add is two)."""
        return 2.0 * self.cube.macs_per_cycle * self.cube_cores * self.clock_hz

    def cores(self, unit: str) -> range:
        """The core numbers holding ``unit`` (``cube`` or ``vector``): every core of a coupled
        machine; on a split one the cube cores first, then the vector cores."""
        if self.layout == "coupled":
            return range(self.cube_cores)
        return range(self.cube_cores) if unit == "cube" else range(self.cube_cores, self.cube_cores + self.vector_cores)

    def buffer(self, name: str) -> Buffer:
        """The buffer called ``name`` (a ``CompileError`` naming the machine's where there is none)."""
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        raise CompileError(f"npu machine '{self.name}' has no buffer '{name}' (it has: {self._names(self.buffers)})")

    def has_path(self, source: str, destination: str) -> bool:
        """Whether a mover moves data ``source -> destination``."""
        return any((source, destination) in mover.paths for mover in self.movers)

    def mover(self, source: str, destination: str) -> Mover:
        """The mover serving the path ``source -> destination``."""
        for mover in self.movers:
            if (source, destination) in mover.paths:
                return mover
        paths = ", ".join(f"{s}->{d}" for m in self.movers for s, d in m.paths)
        raise CompileError(f"npu machine '{self.name}' moves no data {source}->{destination} (paths: {paths})")

    @staticmethod
    def _names(items) -> str:
        return ", ".join(item.name for item in items)

    def to_dict(self) -> dict:
        """The machine as plain data (what ``machine`` reads back from JSON)."""
        data = dataclasses.asdict(self)
        data["sources"] = dict(self.sources)
        return data

    def describe(self) -> str:
        """A table of the machine's figures, each with its source."""
        lines = [f"npu machine '{self.name}' ({self.layout}): {self.peak_flops / 1e12:.0f} TFLOP/s fp16 peak"]
        for key, value in _flatten(self.to_dict()).items():
            if key.startswith("sources") or key == "name" or key.endswith(".name"):
                continue
            source = _source_of(self.sources, key)
            lines.append(f"  {key:42s} {value!s:>14}   {source}")
        return "\n".join(lines)


def _flatten(data, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list | tuple) and data and isinstance(data[0], dict):
        items = ((entry.get("name", str(k)), entry) for k, entry in enumerate(data))
    else:
        return {prefix: data}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _source_of(sources: Mapping[str, str], key: str) -> str:
    """The source recorded for ``key`` or its nearest recorded prefix."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:end]))
        if found:
            return found
    return "(no source given)"


def _fail(machine_name: str, message: str) -> None:
    raise CompileError(f"npu machine '{machine_name}': {message}")


def _validate(machine: Machine) -> None:
    """Every field of ``machine`` sensible, or a ``CompileError`` naming the first that is not."""
    name = machine.name
    if machine.layout not in LAYOUTS:
        _fail(name, f"layout '{machine.layout}' is not one of {', '.join(LAYOUTS)}")
    if machine.clock_hz <= 0:
        _fail(name, f"clock_hz must be positive (got {machine.clock_hz})")
    if machine.cube_cores < 1 or machine.vector_cores < 1:
        _fail(name, "cube_cores and vector_cores must each be at least 1")
    if machine.layout == "coupled" and machine.cube_cores != machine.vector_cores:
        _fail(name, "a coupled machine's cores hold both units: cube_cores must equal vector_cores")
    kinds = ("core",) if machine.layout == "coupled" else ("cube", "vector")
    for size in ("m", "n", "k"):
        if getattr(machine.cube, size) < 1:
            _fail(name, f"cube.{size} must be at least 1")
    if machine.vector.repeat_bytes < 1:
        _fail(name, "vector.repeat_bytes must be at least 1")
    seen = set()
    for buffer in machine.buffers:
        where = f"buffer {buffer.name}"
        if buffer.name in seen or buffer.name == GM:
            _fail(name, f"{where} is named twice (or 'GM', the global memory's name)")
        seen.add(buffer.name)
        if buffer.on not in kinds:
            _fail(name, f"{where} is on '{buffer.on}' cores; a {machine.layout} machine has {', '.join(kinds)}")
        if buffer.alignment < 1 or buffer.alignment & (buffer.alignment - 1):
            _fail(name, f"{where}: alignment {buffer.alignment} is not a power of two")
        if buffer.capacity < 1 or buffer.capacity % buffer.alignment:
            _fail(name, f"{where}: capacity {buffer.capacity} is not a positive multiple of its alignment")
        if buffer.banks < 1 or buffer.bank_bytes < 1:
            _fail(name, f"{where}: banks and bank_bytes must each be at least 1")
    places = seen | {GM}
    for mover in machine.movers:
        where = f"mover {mover.name}"
        if mover.name not in MOVERS:
            _fail(name, f"{where} is none of the movers {', '.join(MOVERS)}")
        if mover.on not in kinds:
            _fail(name, f"{where} is on '{mover.on}' cores; a {machine.layout} machine has {', '.join(kinds)}")
        if mover.bytes_per_cycle <= 0 or mover.latency < 0 or mover.burst < 1:
            _fail(name, f"{where}: bytes_per_cycle must be positive, latency non-negative, burst at least 1")
        for source, destination in mover.paths:
            if source not in places or destination not in places:
                _fail(name, f"{where}: path {source}->{destination} names a place the machine lacks")
    memory = machine.memory
    if min(memory.l2_bytes, memory.hbm_bytes) < 1 or min(memory.l2_bytes_per_cycle, memory.hbm_bytes_per_cycle) <= 0:
        _fail(name, "memory: sizes and bandwidths must be positive")
    if memory.hbm_latency < 0:
        _fail(name, "memory: hbm_latency must be non-negative")


def _build(data: Mapping) -> Machine:
    """A ``Machine`` from plain data (``Machine.to_dict``'s format)."""
    name = str(data.get("name", "?"))
    try:
        return Machine(
            name=name,
            layout=data["layout"],
            clock_hz=float(data["clock_hz"]),
            cube_cores=int(data["cube_cores"]),
            vector_cores=int(data["vector_cores"]),
            cube=Cube(**data.get("cube", {})),
            vector=Vector(**data.get("vector", {})),
            buffers=tuple(Buffer(**entry) for entry in data["buffers"]),
            movers=tuple(
                Mover(**{**entry, "paths": tuple(tuple(path) for path in entry["paths"])}) for entry in data["movers"]
            ),
            memory=MemorySystem(**data["memory"]),
            sources=dict(data.get("sources", {})),
        )
    except KeyError as err:
        raise CompileError(f"npu machine '{name}': missing field {err}") from err
    except (TypeError, ValueError) as err:
        raise CompileError(f"npu machine '{name}': {err}") from err


def machine(spec: str | Path | Mapping | Machine) -> Machine:
    """The machine ``spec`` names: a preset (``npu``, ``npu-split``), a JSON file of a machine
    (``Machine.to_dict``'s format; unspecified cube and vector fields take their defaults), a
    mapping of the same, or a ``Machine``."""
    if isinstance(spec, Machine):
        return spec
    if isinstance(spec, Mapping):
        return _build(spec)
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise CompileError(f"no npu machine '{spec}' (presets: {', '.join(PRESETS)}; or a JSON file of one)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompileError(f"npu machine file '{path}' is not readable JSON ({err})") from err
    if not isinstance(data, dict):
        raise CompileError(f"npu machine file '{path}' does not hold an object")
    return _build(data)


# ----------------------------------------------------------------------------------- the presets

_ASCEND_C_STORAGE = "Ascend C programming guide, 'Storage Units' (CANN 8.0): buffers and which mover serves which path"
_ASCEND_C_ALIGN = (
    "Ascend C 'General Restrictions' alignment table (CANN 8.0): UB and L1 32 B, L0A/L0B 512 B, L0C 64 B, GM none"
)
_HOT_CHIPS = "Huawei, 'DaVinci: A Scalable Architecture for Neural Network Computing', Hot Chips 31 (2019)"

SOURCES_COUPLED = {
    "layout": "Ascend 910 (Da Vinci): cube, vector and scalar units in one AI core (" + _HOT_CHIPS + ")",
    "clock_hz": "1.0 GHz: Ascend 910's 256 TFLOP/s fp16 over 32 cores of 4096 MACs (256e12 / (32 x 4096 x 2))",
    "cube_cores": "32 AI cores (Ascend 910, " + _HOT_CHIPS + ")",
    "vector_cores": "the same 32 cores (coupled)",
    "cube": "16x16x16 fp16 MACs a cycle into fp32 (" + _HOT_CHIPS + "); latency 8 cycles: model assumption",
    "vector": "2048-bit (256-byte) SIMD repeat a cycle (" + _HOT_CHIPS + "); latency 4 cycles: model assumption",
    "buffers": "capacities: L1 1 MiB, L0A/L0B 64 KiB, L0C 256 KiB, UB 256 KiB (Da Vinci Max core, "
    + _HOT_CHIPS
    + "; the figures issue 37 fixes); "
    + _ASCEND_C_ALIGN,
    "buffers.UB.banks": "16 banks of 32 B: model assumption (Ascend C's tuning guide warns of UB bank conflicts "
    "without giving the geometry; 16 x 32 B serves one 512-byte read and write pair a cycle)",
    "buffers.L1.banks": "16 banks of 64 B: model assumption (one 512-byte fractal a cycle to MTE1, two reads)",
    "buffers.L0A.banks": "one 512-byte fractal a cycle to the cube: 16 banks of 32 B (derived from the cube rate)",
    "buffers.L0B.banks": "as L0A",
    "buffers.L0C.banks": "one 16x16 fp32 fractal (1 KiB) a cycle read-modify-written: 16 banks of 64 B (derived)",
    "movers": _ASCEND_C_STORAGE,
    "movers.MTE2": "GM->L1/UB in 512-byte bursts (Ascend C: GM transfers are fastest 512-byte aligned); "
    "128 B/cycle a core and 200 cycles from L2: model assumptions (32 cores x 128 B exceed HBM, as a port should)",
    "movers.MTE1": "L1->L0A/L0B (img2col and fractal transposition on the way): 512 B/cycle, one fp16 fractal a "
    "cycle, what the cube consumes a cycle from each operand (derived); latency 16 cycles: model assumption",
    "movers.FIXPIPE": "L0C->GM/UB with fp32->fp16 and ReLU/bias on the way: 256 B/cycle, one fp32 fractal in 4 "
    "cycles (model assumption: an output tile is drained once per deep reduction); latency 32: assumption",
    "movers.MTE3": "UB->GM: 128 B/cycle, latency 200 (model assumptions, as MTE2)",
    "memory.l2_bytes": "32 MiB on-chip L2 (Ascend 910)",
    "memory.l2_bytes_per_cycle": "4096 B/cycle (4 TB/s at 1 GHz): model assumption, ~3.4x HBM",
    "memory.hbm_bytes": "32 GiB HBM2 (Ascend 910: four stacks)",
    "memory.hbm_bytes_per_cycle": "1.2 TB/s HBM2 (Ascend 910) at 1 GHz: 1200 B/cycle",
    "memory.hbm_latency": "300 cycles beyond L2: model assumption",
}

SOURCES_SPLIT = {
    **SOURCES_COUPLED,
    "layout": "Ascend 910B / Atlas A2: separated AI cores, one cube core (AIC) to two vector cores (AIV) "
    "(Ascend C programming guide, 'separated mode' glossary: AIC, AIV)",
    "clock_hz": "1.8 GHz: model assumption; 24 cubes x 4096 MACs x 2 x 1.8 GHz = 354 TFLOP/s, inside the 313-376 "
    "TFLOP/s fp16 published for 910B parts",
    "cube_cores": "24 AIC (Ascend 910B-class parts have 20-25): model choice",
    "vector_cores": "48 AIV: two per cube core (AIC:AIV = 1:2)",
    "buffers": "L1 512 KiB, L0A/L0B 64 KiB, L0C 128 KiB on cube cores; UB 192 KiB on vector cores: model choices "
    "after Atlas A2's published tiling examples (user files may change them); " + _ASCEND_C_ALIGN,
    "movers.FIXPIPE": "split mode: L0C->GM/L1 (Ascend C: FixPipe serves L0C->{GM, L1} on separated cores); "
    "256 B/cycle, latency 32: model assumptions",
    "movers.MTE2": "GM->L1 on cube cores, GM->UB on vector cores (each kind of core has its own MTE2), 512-byte "
    "bursts; 128 B/cycle, 200 cycles: model assumptions",
    "memory.l2_bytes": "192 MiB L2 (Ascend 910B)",
    "memory.l2_bytes_per_cycle": "4096 B/cycle: model assumption (7.4 TB/s at 1.8 GHz, ~4.6x HBM)",
    "memory.hbm_bytes": "64 GiB HBM2e (Ascend 910B)",
    "memory.hbm_bytes_per_cycle": "1.6 TB/s HBM2e (Ascend 910B) at 1.8 GHz: 889 B/cycle",
}


def _coupled() -> Machine:
    return Machine(
        name="npu",
        layout="coupled",
        clock_hz=1.0e9,
        cube_cores=32,
        vector_cores=32,
        cube=Cube(),
        vector=Vector(),
        buffers=(
            Buffer("L1", 1 << 20, 32, 16, 64, "core"),
            Buffer("L0A", 64 << 10, 512, 16, 32, "core"),
            Buffer("L0B", 64 << 10, 512, 16, 32, "core"),
            Buffer("L0C", 256 << 10, 64, 16, 64, "core"),
            Buffer("UB", 256 << 10, 32, 16, 32, "core"),
        ),
        movers=(
            Mover("MTE2", ((GM, "L1"), (GM, "UB")), 128.0, 200, 512, "core"),
            Mover("MTE1", (("L1", "L0A"), ("L1", "L0B")), 512.0, 16, 32, "core"),
            Mover("FIXPIPE", (("L0C", GM), ("L0C", "UB")), 256.0, 32, 64, "core"),
            Mover("MTE3", (("UB", GM),), 128.0, 200, 32, "core"),
        ),
        memory=MemorySystem(32 << 20, 4096.0, 32 << 30, 1200.0, 300),
        sources=SOURCES_COUPLED,
    )


def _split() -> Machine:
    return Machine(
        name="npu-split",
        layout="split",
        clock_hz=1.8e9,
        cube_cores=24,
        vector_cores=48,
        cube=Cube(),
        vector=Vector(),
        buffers=(
            Buffer("L1", 512 << 10, 32, 16, 64, "cube"),
            Buffer("L0A", 64 << 10, 512, 16, 32, "cube"),
            Buffer("L0B", 64 << 10, 512, 16, 32, "cube"),
            Buffer("L0C", 128 << 10, 64, 16, 64, "cube"),
            Buffer("UB", 192 << 10, 32, 16, 32, "vector"),
        ),
        movers=(
            Mover("MTE2", ((GM, "L1"),), 128.0, 200, 512, "cube"),
            Mover("MTE2", ((GM, "UB"),), 128.0, 200, 512, "vector"),
            Mover("MTE1", (("L1", "L0A"), ("L1", "L0B")), 512.0, 16, 32, "cube"),
            Mover("FIXPIPE", (("L0C", GM), ("L0C", "L1")), 256.0, 32, 64, "cube"),
            Mover("MTE3", (("UB", GM),), 128.0, 200, 32, "vector"),
        ),
        memory=MemorySystem(192 << 20, 4096.0, 64 << 30, 889.0, 300),
        sources=SOURCES_SPLIT,
    )


#: the machines a target name selects
PRESETS: dict[str, Machine] = {"npu": _coupled(), "npu-split": _split()}
