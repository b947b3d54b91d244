"""A single op compiled with its adjoints: what a user with a new layer calls.

layer = neoflow.compile(op, target="cpu", grad=True)
out = layer.run({"A": a, "B": b})
grads = layer.backward({"A": a, "B": b}, {"dC": dout})   # {"A": dA, "B": dB}
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from neoflow.autodiff import grad as derive
from neoflow.errors import CompileError
from neoflow.fusion.policies import FusionPolicy, load_policy
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import check_inputs
from neoflow.ir.op import Op
from neoflow.runtime.fusing import DEFAULT_POLICY, build_executor
from neoflow.targets import check_target


class CompiledOp:
    """``op`` compiled for ``target``; with ``grad``, its adjoints too (``adjoints``
    maps input name → adjoint op; ``backward`` evaluates them); ``fusion`` is
    the fusion policy for the forward and backward graphs; ``precision`` the tensor cores'
    (``cuda``, ``tensorcore``)."""

    def __init__(
        self,
        op: Op,
        target: str,
        grad: bool,
        fusion: str | FusionPolicy = DEFAULT_POLICY,
        precision: str | None = None,
    ) -> None:
        check_target(target)
        self.op = op
        self.target = target
        self.fusion = load_policy(fusion)
        self.precision = precision
        self.forward_graph = Graph.from_ops([op])
        self._forward = build_executor(target, self.forward_graph, [op.name], self.fusion, precision)
        self.adjoints: dict[str, Op] = derive(op) if grad else {}
        self._backward = None
        self._both = None
        if self.adjoints:
            self.backward_graph = Graph.from_ops(
                [op, *self.adjoints.values()], outputs=[a.name for a in self.adjoints.values()]
            )
            keep = [a.name for a in self.adjoints.values()]
            self._backward = build_executor(target, self.backward_graph, keep, self.fusion, precision)

    def _inputs(self, graph: Graph, given: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return check_inputs(graph.free_inputs, given, self.op.name)

    def run(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The op's output on ``inputs`` (arrays by input name)."""
        return self._forward.run(self._inputs(self.forward_graph, inputs))[self.op.name]

    def forward_backward(
        self, inputs: Mapping[str, np.ndarray], output_grad: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The output and the input adjoints in one run (the forward op computed once)."""
        if self._backward is None:
            raise CompileError("compiled without grad=True (or the op has no float inputs)", op=self.op.name)
        if self._both is None:
            keep = [self.op.name, *(a.name for a in self.adjoints.values())]
            self._both = build_executor(self.target, self.backward_graph, keep, self.fusion, self.precision)
        outputs = self._both.run(self._inputs(self.backward_graph, {**inputs, **output_grad}))
        return outputs[self.op.name], {name: outputs[a.name] for name, a in self.adjoints.items()}

    def backward(
        self, inputs: Mapping[str, np.ndarray], output_grad: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Adjoints of the op's inputs, by input name, given the inputs and the output
        adjoint (``{"d<Out>": array}``)."""
        if self._backward is None:
            raise CompileError("compiled without grad=True (or the op has no float inputs)", op=self.op.name)
        outputs = self._backward.run(self._inputs(self.backward_graph, {**inputs, **output_grad}))
        return {name: outputs[adjoint.name] for name, adjoint in self.adjoints.items()}
