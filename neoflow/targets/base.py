"""What every target implements, and the executor every target can fall back on.

A target is a ``Target``: its name, an executor factory (a graph, the tensors to
keep, a fusion plan's kernel groups and sliced kernels → an object with ``run``,
``run_op``, ``op_call`` and ``kernel_call``) and the fusion cost model it hands to
the planner (fusion never imports a target).  ``run_graph`` runs an executor's
graph op by op, freeing tensors at their last use (``memory.plan_memory``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

from neoflow.errors import CompileError
from neoflow.fusion.cost import CostModel, Machine
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate_op
from neoflow.ir.op import Op
from neoflow.targets.memory import MemoryPlan, plan_memory


def run_graph(executor, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``executor``'s graph on ``inputs`` (every graph input by name,
    checked by the caller) op by op with its ``run_op``, dropping each tensor
    after its last reader; returns the kept tensors by name."""
    values = dict(inputs)
    for op, dead in zip(executor.graph.ops, executor.plan.free_after, strict=True):
        values[op.name] = executor.run_op(op, values)
        for name in dead:
            values.pop(name, None)
    return {name: values[name] for name in executor.keep}


def sequential_call(executor, names: Collection[str], values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
    """A call running the ops ``names`` of ``executor``'s graph one after another
    (each through its ``op_call``, on the values the ones before produced),
    returning their values by name."""
    ops = {op.name: op for op in executor.graph.ops}
    known = dict(values)
    calls = []
    for name in names:
        call = executor.op_call(ops[name], known)
        known[name] = call()
        calls.append((name, call))
    return lambda: {name: call() for name, call in calls}


class OpByOpExecutor:
    """What an executor running ``graph`` op by op holds: the graph, the tensors to ``keep``
    (each once) and the memory ``plan`` that frees every other tensor after its last reader."""

    def __init__(self, graph: Graph, keep: Collection[str]) -> None:
        self.graph = graph
        self.keep = tuple(dict.fromkeys(keep))
        self.plan: MemoryPlan = plan_memory(graph, self.keep)


class InterpreterExecutor(OpByOpExecutor):
    """Runs ``graph`` with the reference interpreter, handing back the tensors in
    ``keep`` and dropping every other tensor after its last reader (``plan``).
    A plan's kernel ``groups`` and ``sliced`` kernels change nothing here: every op
    runs alone, in order."""

    target = "interp"

    def __init__(
        self, graph: Graph, keep: Collection[str], groups: Collection[Collection[str]] = (), sliced: Collection = ()
    ) -> None:
        super().__init__(graph, keep)

    def run_op(self, op: Op, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The value of ``op`` (one of the graph's) from its inputs' ``values``."""
        return evaluate_op(op, {name: values[name] for name in op.input_names})

    def op_call(self, op: Op, values: Mapping[str, np.ndarray]) -> Callable[[], np.ndarray]:
        """A call computing ``op`` from ``values`` again and again (for timing it alone)."""
        return lambda: self.run_op(op, values)

    def kernel_call(self, names: Collection[str], values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
        """A call computing the ops ``names`` (one kernel of a fusion plan) in turn."""
        return sequential_call(self, names, values)

    def run(self, inputs: Mapping[str, np.ndarray], recycle: bool = False) -> dict[str, np.ndarray]:
        """The kept tensors by name, from every graph input by name (``recycle``, which lets
        a compiled executor reuse its output buffers, changes nothing here)."""
        return run_graph(self, inputs)


#: ``executor(graph, keep, groups, sliced)``: a target's executor for a fused graph
ExecutorFactory = Callable[..., object]


@dataclass(frozen=True)
class Target:
    """A code-generation target: ``name``, a one-line ``description``, its
    ``executor`` factory, the fusion ``cost_model`` it plans with (a function
    making one) and the name of its ``hardware`` description in
    ``codegen.hardware.TARGETS`` (None: it has none, as the interpreter)."""

    name: str
    description: str
    executor: ExecutorFactory
    cost_model: Callable[[], CostModel]
    hardware: str | None = None


def nominal_cost_model() -> CostModel:
    """A cost model with nominal machine figures and no schedule of a code generator."""
    return CostModel(Machine())


def exact_only(target: str, precision: str | None) -> None:
    """Refuse a tensor-core ``precision`` on ``target``, which computes in the graph's dtypes."""
    if precision not in (None, "fp32"):
        raise CompileError(f"precision '{precision}' needs tensor cores (target cuda or tensorcore), not '{target}'")


def _interpreter(graph, keep, groups=(), sliced=(), precision=None):
    exact_only("interp", precision)
    return InterpreterExecutor(graph, keep, groups, sliced)


INTERPRETER = Target("interp", "the numpy reference interpreter", _interpreter, nominal_cost_model)
