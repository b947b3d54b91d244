"""Graphs: a DAG of ops with named inputs and outputs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from neoflow.errors import ShapeError
from neoflow.ir.op import Op, Tensor


@dataclass(frozen=True)
class Graph:
    """Ops in topological order, the graph's input tensors and its output names.

    Build one with ``Graph.from_ops``, which orders the ops and checks that
    every tensor is defined once and that no op depends on itself.
    ``parameters`` holds values for some inputs (an ONNX model's initializers);
    evaluation uses them for inputs the caller does not give.  ``source_names``
    maps tensor names to the names they had in the imported file.
    ``state_updates`` maps a parameter that the graph itself updates (a
    BatchNormalization running mean in training mode) to the tensor holding
    its next value; ``noise_inputs`` are inputs a runtime fills with fresh
    uniform [0, 1) noise on every run (dropout masks in training mode);
    ``stop_gradients`` are tensors autodiff treats as constants (an import's copy of a
    mean that a variance reads: the variance's gradient through the mean is zero in exact
    arithmetic, and computed it is rounding noise of a sum of deviations);
    ``batch_statistics`` are means over the batch a training-mode layer normalises with (a
    BatchNormalization's mean and variance): what data-parallel training averages across ranks
    to synchronise them.
    """

    ops: tuple[Op, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[str, ...]
    parameters: Mapping[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    source_names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    state_updates: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    noise_inputs: tuple[str, ...] = field(default=(), compare=False, repr=False)
    stop_gradients: tuple[str, ...] = field(default=(), compare=False, repr=False)
    batch_statistics: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @staticmethod
    def from_ops(
        ops: list[Op], outputs: list[str] | None = None, parameters: Mapping[str, np.ndarray] | None = None
    ) -> Graph:
        """Order ``ops`` topologically; inputs are the tensors no op defines;
        outputs default to the tensors no op reads."""
        producers: dict[str, Op] = {}
        for op in ops:
            if op.name in producers:
                raise ShapeError(f"tensor '{op.name}' is defined twice", op=op.name)
            producers[op.name] = op
        order: list[Op] = []
        state: dict[str, str] = {}

        def visit(op: Op, path: list[str]) -> None:
            if state.get(op.name) == "done":
                return
            if state.get(op.name) == "active":
                cycle = " -> ".join([*path[path.index(op.name) :], op.name])
                raise ShapeError(f"the ops form a cycle: {cycle}", op=op.name)
            state[op.name] = "active"
            for name in op.input_names:
                if name in producers:
                    visit(producers[name], [*path, op.name])
            state[op.name] = "done"
            order.append(op)

        for op in ops:
            visit(op, [])
        inputs: dict[str, Tensor] = {}
        for op in order:
            for tensor in op.inputs:
                if tensor.name not in producers:
                    inputs.setdefault(tensor.name, tensor)
                elif producers[tensor.name].output != tensor:
                    raise ShapeError(
                        f"reads '{tensor.name}' as {tensor} but it is defined as {producers[tensor.name].output}",
                        op=op.name,
                    )
        read = {name for op in order for name in op.input_names}
        if outputs is None:
            outputs = [op.name for op in order if op.name not in read]
        for name in outputs:
            if name not in producers:
                raise ShapeError(f"output '{name}' is not defined by any op")
        return Graph(tuple(order), tuple(inputs.values()), tuple(outputs), dict(parameters or {}))

    @property
    def free_inputs(self) -> tuple[Tensor, ...]:
        """The inputs without a parameter value: what a caller must give."""
        return tuple(t for t in self.inputs if t.name not in self.parameters)

    @property
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the graph (inputs and op outputs), by name."""
        table = {t.name: t for t in self.inputs}
        table.update({op.name: op.output for op in self.ops})
        return table

    @cached_property
    def ops_by_name(self) -> Mapping[str, Op]:
        """Every op, by the name of the tensor it defines (worked out once; not to be changed)."""
        return {op.name: op for op in self.ops}

    @cached_property
    def positions(self) -> Mapping[str, int]:
        """Each op's position in ``ops``, by the name of the tensor it defines (worked out once; not to
        be changed)."""
        return {op.name: k for k, op in enumerate(self.ops)}

    def op(self, name: str) -> Op:
        """The op that defines tensor ``name``."""
        return self.ops_by_name[name]

    def consumers(self, name: str) -> list[Op]:
        """The ops that read tensor ``name``."""
        return [op for op in self.ops if name in op.input_names]

    def __str__(self) -> str:
        from neoflow.ir.printer import print_graph

        return print_graph(self)
