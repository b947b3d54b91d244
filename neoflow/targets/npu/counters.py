"""Performance counters of a scheduled NPU program, its report, and its timeline as a trace and a chart.

From the instructions and their cycles (the static schedule, which the replay
proves the hardware keeps): per pipe its busy cycles and ratio of the run (the
way Ascend's profiler reports cube / vector / MTE ratios), bytes on each data
path, the peak occupancy of each buffer (a region held from the start of the
instruction writing it to the end of the last one reading it), stall cycles by
cause — a pipe idle in a ``wait_flag`` for data (a flag down the data flow), for a
free buffer (a flag back up it), or held by its own interlock (``unit``) — and the
cube's utilization against its peak.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from neoflow.targets.npu.isa import PIPES, Program
from neoflow.targets.npu.machine import GM
from neoflow.targets.npu.schedule import Schedule, dependencies

#: the flags that hand data down the flow (every other flag frees a buffer back up it)
DATA_FLAGS = {
    ("MTE2", "MTE1"),
    ("MTE2", "VECTOR"),
    ("MTE1", "CUBE"),
    ("CUBE", "FIXPIPE"),
    ("FIXPIPE", "VECTOR"),
    ("VECTOR", "MTE3"),
    ("FIXPIPE", "MTE2"),  # across cores: a cube core's sums stored for a vector core (a split machine)
}
STALLS = ("data", "buffer", "unit")


@dataclass
class Counters:
    """What one or more runs counted (``add`` sums them: a graph's ops one after another)."""

    cycles: int = 0
    clock_hz: float = 1e9
    cube_cores: int = 1
    macs_per_cycle: int = 4096
    busy: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    paths: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    stalls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    macs: int = 0
    cores_used: int = 0
    instructions: int = 0

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    @property
    def gm_bytes(self) -> int:
        """Bytes read from and written to GM."""
        return sum(v for k, v in self.paths.items() if k.startswith(GM) or k.endswith(GM))

    @property
    def hbm_bytes(self) -> int:
        """Bytes the programs' first reads fetched from HBM."""
        return self.paths.get("HBM->L2", 0)

    def cube_utilization(self, cores: int | None = None) -> float:
        """Multiply-adds done over what ``cores`` cubes (default: every cube core) could do in the run."""
        cores = cores or self.cube_cores
        return self.macs / max(1, self.cycles * self.macs_per_cycle * cores)

    def ratio(self, pipe: str) -> float:
        """The pipe's busy cycles over the run's cycles on the cores used (Ascend's ``*_ratio``)."""
        return self.busy.get(pipe, 0) / max(1, self.cycles * max(1, self.cores_used))

    def add(self, other: Counters) -> None:
        self.cycles += other.cycles
        self.clock_hz, self.cube_cores, self.macs_per_cycle = other.clock_hz, other.cube_cores, other.macs_per_cycle
        for mine, theirs in ((self.busy, other.busy), (self.paths, other.paths), (self.stalls, other.stalls)):
            for key, value in theirs.items():
                mine[key] += value
        for key, value in other.peak.items():
            self.peak[key] = max(self.peak[key], value)
        self.macs += other.macs
        self.cores_used = max(self.cores_used, other.cores_used)
        self.instructions += other.instructions

    def report(self) -> str:
        """The counters as a table."""
        lines = [
            f"cycles {self.cycles}  ({self.seconds * 1e6:.1f} us at {self.clock_hz / 1e9:.2f} GHz), "
            f"{self.instructions} instructions, {self.cores_used} cores used",
            f"cube utilization {self.cube_utilization() * 100:.1f} % of all cube cores' peak "
            f"({self.cube_utilization(self.cores_used or 1) * 100:.1f} % of the cores used)",
            f"GM bytes {self.gm_bytes}",
            "",
            "| pipe | busy cycles | ratio |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {p} | {self.busy[p]} | {self.ratio(p):.3f} |" for p in PIPES if p in self.busy]
        lines += ["", "| path | bytes |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in sorted(self.paths.items())]
        lines += ["", "| buffer | peak bytes (a core) |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in sorted(self.peak.items())]
        lines += ["", "| stall | cycles |", "| --- | --- |"]
        lines += [f"| waiting on {k} | {self.stalls.get(k, 0)} |" for k in STALLS]
        return "\n".join(lines) + "\n"


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (start, end) with those that overlap joined."""
    joined: list[list[int]] = []
    for begin, end in sorted(spans):
        if joined and begin < joined[-1][1]:
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([begin, end])
    return [(begin, end) for begin, end in joined]


def count(program: Program, schedule: Schedule) -> Counters:
    """The counters of ``program`` run as ``schedule`` says."""
    machine = program.machine
    counters = Counters(
        cycles=schedule.cycles,
        clock_hz=machine.clock_hz,
        cube_cores=machine.cube_cores,
        macs_per_cycle=machine.cube.macs_per_cycle,
        instructions=len(program.instructions),
    )
    pipe_free: dict[tuple, int] = defaultdict(int)
    cores = set()
    held: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # (core, buffer, offset, size) -> (start, end)
    last_read: dict[int, int] = {}
    depends = schedule.depends or dependencies(program)
    for index, instruction in enumerate(program.instructions):
        for earlier in depends[index]:
            if any(r.overlaps(w) for r in instruction.reads for w in program.instructions[earlier].writes):
                last_read[earlier] = max(last_read.get(earlier, 0), schedule.dones[index])
    for index, instruction in enumerate(program.instructions):
        pipe = (instruction.core, instruction.pipe)
        start = schedule.starts[index]
        cores.add(instruction.core)
        idle = start - pipe_free[pipe]
        if instruction.is_wait:
            source, destination, _ = instruction.event
            cause = "data" if (source, destination) in DATA_FLAGS else "buffer"
            counters.stalls[cause] += max(0, idle)
        elif instruction.event is None:
            counters.busy[instruction.pipe] += instruction.cycles
            if idle > 0 and pipe_free[pipe] > 0:
                counters.stalls["unit"] += idle
        pipe_free[pipe] = start + instruction.cycles
        if instruction.moved:
            source = instruction.reads[0].space
            counters.paths[f"{source}->{instruction.writes[0].space}"] += instruction.moved
        if instruction.hbm:
            counters.paths["HBM->L2"] += instruction.hbm
        if instruction.opcode == "cube.mmad":
            m, n, k, _ = instruction.data
            counters.macs += m * n * k
        for region in instruction.writes:
            if region.space != GM:
                end = max(last_read.get(index, schedule.dones[index]), schedule.dones[index])
                held[(instruction.core, region.space, region.offset, region.size)].append((start, end))
    occupancy: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # (core, buffer) -> (time, +/- bytes)
    for (core, buffer, _, size), spans in held.items():
        # one region written again while still held (an accumulator's successive mmads) is held once
        for begin, end in _merged(spans):
            occupancy[(core, buffer)] += [(begin, size), (end, -size)]
    for (_, buffer), events in occupancy.items():
        level = peak = 0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):
            level += change
            peak = max(peak, level)
        counters.peak[buffer] = max(counters.peak[buffer], peak)
    counters.cores_used = len(cores)
    return counters


def chrome_trace(runs: list[tuple[str, Program, Schedule, int]]) -> str:
    """The timeline of ``runs`` (``(name, program, schedule, first cycle)``) as Chrome trace-event
    JSON (opens in Perfetto): a process per core, a thread per pipe, an event per instruction."""
    events = []
    for name, program, schedule, offset in runs:
        scale = 1e6 / program.machine.clock_hz  # cycles -> microseconds
        for index, instruction in enumerate(program.instructions):
            start = offset + schedule.starts[index]
            events.append(
                {
                    "name": instruction.opcode,
                    "cat": name,
                    "ph": "X",
                    "ts": start * scale,
                    "dur": max(instruction.cycles, 1) * scale,
                    "pid": instruction.core,
                    "tid": PIPES.index(instruction.pipe),
                    "args": {"op": name, "index": index, "cycle": start, "text": instruction.text()[:200]},
                }
            )
    cores = sorted({e["pid"] for e in events})
    for core in cores:
        events.append({"name": "process_name", "ph": "M", "pid": core, "args": {"name": f"core {core}"}})
        for number, pipe in enumerate(PIPES):
            events.append({"name": "thread_name", "ph": "M", "pid": core, "tid": number, "args": {"name": pipe}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ns"})


def gantt(runs: list[tuple[str, Program, Schedule, int]], path, cores: int = 2) -> None:
    """A PNG Gantt chart of the first ``cores`` cores' pipes over ``runs`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = sorted({i.core for _, p, _, _ in runs for i in p.instructions})[:cores]
    rows = [(c, p) for c in shown for p in PIPES]
    figure, axes = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.2))
    colours = {p: f"C{k}" for k, p in enumerate(PIPES)}
    for _, program, schedule, offset in runs:
        for index, instruction in enumerate(program.instructions):
            if instruction.core not in shown or instruction.event is not None:
                continue
            row = rows.index((instruction.core, instruction.pipe))
            start = offset + schedule.starts[index]
            axes.broken_barh([(start, max(instruction.cycles, 1))], (row - 0.4, 0.8), color=colours[instruction.pipe])
    axes.set_yticks(range(len(rows)), [f"core {c} {p}" for c, p in rows])
    axes.invert_yaxis()
    axes.set_xlabel("cycle")
    axes.set_title(", ".join(dict.fromkeys(name for name, *_ in runs))[:120])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
