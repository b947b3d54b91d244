"""Executors: run a graph's ops in order on one target, freeing tensors at their last use."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate_op
from neoflow.runtime.memory import MemoryPlan, plan_memory


class InterpreterExecutor:
    """Runs ``graph`` with the reference interpreter, handing back the tensors in
    ``keep`` and dropping every other tensor after its last reader (``plan``)."""

    target = "interp"

    def __init__(self, graph: Graph, keep: Collection[str]) -> None:
        self.graph = graph
        self.keep = tuple(dict.fromkeys(keep))
        self.plan: MemoryPlan = plan_memory(graph, self.keep)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Evaluate the graph on ``inputs`` (every graph input by name, checked by
        the caller); returns the kept tensors by name."""
        values = dict(inputs)
        for op, dead in zip(self.graph.ops, self.plan.free_after, strict=True):
            values[op.name] = evaluate_op(op, {name: values[name] for name in op.input_names})
            for name in dead:
                values.pop(name, None)
        return {name: values[name] for name in self.keep}


def _cpu(graph: Graph, keep: Collection[str]):
    from neoflow.runtime.cpu import CpuExecutor

    return CpuExecutor(graph, keep)


EXECUTORS = {"interp": InterpreterExecutor, "cpu": _cpu}
