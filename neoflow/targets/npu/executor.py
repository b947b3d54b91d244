"""The NPU executor: every op of a fused graph compiled to NPU programs, proven deterministic, simulated.

At construction each op becomes its phases (``compile.compile_op``), each phase
gets its static schedule and is replayed against it (a program whose flags let
the hardware run it otherwise is an error here, not a wrong figure later), and
its counters are taken.  A run simulates every op functionally on numpy copies
of GM and the buffers; ``counters`` then holds the run's counters (the schedule
is static, so they are the same every run).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np

from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op
from neoflow.targets.base import OpByOpExecutor, run_graph, sequential_call
from neoflow.targets.npu.compile import OpProgram, compile_op
from neoflow.targets.npu.counters import Counters, chrome_trace, count, gantt
from neoflow.targets.npu.machine import Machine, machine
from neoflow.targets.npu.replay import replay
from neoflow.targets.npu.simulate import run_program

#: precisions the cube offers: it reads fp16 and sums in fp32
PRECISIONS = (None, "fp16")


class NpuExecutor(OpByOpExecutor):
    """Runs ``graph`` on the NPU model ``machine_spec`` (a preset's name, a JSON file, a ``Machine``)."""

    def __init__(
        self,
        graph: Graph,
        keep: Collection[str],
        groups: Collection[Collection[str]] = (),
        sliced: Collection = (),
        precision: str | None = None,
        machine_spec: str | Machine = "npu",
    ) -> None:
        super().__init__(graph, keep)
        if precision not in PRECISIONS:
            raise CompileError(f"precision '{precision}' is not the npu's: its cube reads fp16 and sums in fp32")
        self.machine = machine(machine_spec)
        self.target = self.machine.name
        self.programs: dict[str, OpProgram] = {}
        self.op_counters: dict[str, Counters] = {}
        for op in graph.ops:
            compiled = compile_op(op, self.machine)
            totals = Counters()
            for (_, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
                replay(program, against=schedule)
                totals.add(count(program, schedule))
            self.programs[op.name] = compiled
            self.op_counters[op.name] = totals
        self.counters: Counters | None = None

    # ------------------------------------------------------------------ running

    def run_op(self, op: Op, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The value of ``op`` as its NPU programs compute it."""
        gm = {
            t.name: np.ascontiguousarray(values[t.name], dtype=dt.numpy_dtype(t.dtype)).reshape(-1) for t in op.inputs
        }
        dtype = dt.numpy_dtype(op.dtype)
        gm[op.name] = np.full(op.output.size, np.nan if np.issubdtype(dtype, np.floating) else 0, dtype)
        compiled = self.programs[op.name]
        for _, program in compiled.phases:
            for name, size in program.tensors.items():
                if name not in gm:  # a workspace of fp32 sums
                    gm[name] = np.full(size // 4, np.nan, np.float32)
            run_program(program, gm)
        return gm[op.name].reshape(op.shape)

    def op_call(self, op: Op, values: Mapping[str, np.ndarray]) -> Callable[[], np.ndarray]:
        return lambda: self.run_op(op, values)

    def kernel_call(self, names: Collection[str], values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
        return sequential_call(self, names, values)

    def run(self, inputs: Mapping[str, np.ndarray], recycle: bool = False) -> dict[str, np.ndarray]:
        """The kept tensors by name, from every graph input by name; ``counters`` the run's."""
        outputs = run_graph(self, inputs)
        self.counters = self.total()
        return outputs

    # ------------------------------------------------------------------ what it counted

    def total(self, names: Collection[str] | None = None) -> Counters:
        """The counters of the ops ``names`` (default: every op) run one after another."""
        totals = Counters()
        for name in names if names is not None else self.programs:
            totals.add(self.op_counters[name])
        return totals

    def cycles(self, names: Collection[str] | None = None) -> int:
        return self.total(names).cycles

    def model_seconds(self, names: Collection[str]) -> float:
        """Simulated seconds of the ops ``names`` (one kernel of a fusion plan)."""
        return self.total(names).seconds

    def describe(self) -> list[tuple[str, str, float]]:
        """Per op: its name, which units run it and in how many instructions, its simulated seconds."""
        rows = []
        for name, compiled in self.programs.items():
            counters = self.op_counters[name]
            what = f"npu {compiled.units}, {counters.instructions} instructions, {counters.cycles} cycles"
            rows.append((name, what, counters.seconds))
        return rows

    def listing(self) -> str:
        """Every op's programs as assembly, each instruction with its scheduled start cycle."""
        parts = []
        for name, compiled in self.programs.items():
            for (what, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
                parts.append(f"; ===== op {name}: {what} phase, {schedule.cycles} cycles\n")
                parts.append(program.listing(list(schedule.starts)))
        return "".join(parts)

    def schedule_table(self) -> str:
        """The static schedule as CSV: op, phase, index, core, pipe, opcode, start, done."""
        lines = ["op,phase,index,core,pipe,opcode,start,done"]
        for name, compiled in self.programs.items():
            for (what, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
                for k, i in enumerate(program.instructions):
                    lines.append(
                        f"{name},{what},{k},{i.core},{i.pipe},{i.opcode},{schedule.starts[k]},{schedule.dones[k]}"
                    )
        return "\n".join(lines) + "\n"

    def _runs(self):
        runs, clock = [], 0
        for name, compiled in self.programs.items():
            for (_, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
                runs.append((name, program, schedule, clock))
                clock += schedule.cycles
        return runs

    def trace(self) -> str:
        """The whole graph's timeline as Chrome trace-event JSON (ops one after another)."""
        return chrome_trace(self._runs())

    def gantt(self, path, cores: int = 2) -> None:
        """A PNG Gantt chart of the graph's timeline (the first ``cores`` cores)."""
        gantt(self._runs(), path, cores)

    def report(self) -> str:
        """The counters of the whole graph, then the cycles of each op."""
        lines = [f"npu machine '{self.machine.name}' ({self.machine.layout})", self.total().report()]
        lines += ["| op | units | cycles |", "| --- | --- | --- |"]
        lines += [f"| {n} | {c.units} | {self.op_counters[n].cycles} |" for n, c in self.programs.items()]
        return "\n".join(lines) + "\n"

    def artifacts(self) -> dict[str, bytes]:
        """What a build directory holds for this target, by file suffix."""
        return {
            ".program.s": self.listing().encode(),
            ".schedule.csv": self.schedule_table().encode(),
            ".trace.json": self.trace().encode(),
            ".npu-report.txt": self.report().encode(),
        }
