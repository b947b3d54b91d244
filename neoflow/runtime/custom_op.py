"""A single op compiled with its adjoints: what a user with a new layer calls.

layer = neoflow.compile(op, target="cpu", grad=True)
out = layer.run({"A": a, "B": b})
grads = layer.backward({"A": a, "B": b}, {"dC": dout})   # {"A": dA, "B": dB}
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

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
        self._partial: dict[frozenset[str], tuple[Graph, object]] = {}  # graph, executor of some adjoints
        if self.adjoints:
            self.backward_graph = self._adjoint_graph(self.adjoints.values())
            keep = [a.name for a in self.adjoints.values()]
            self._backward = build_executor(target, self.backward_graph, keep, self.fusion, precision)

    def _adjoint_graph(self, adjoints: Collection[Op], with_output: bool = False) -> Graph:
        """The graph computing ``adjoints``: the forward op is in it only where an adjoint reads the
        op's output (``exp``'s does, a contraction's does not) or ``with_output`` asks for it —
        a backward would otherwise recompute the forward for nothing."""
        reads_output = with_output or any(self.op.name in a.input_names for a in adjoints)
        keep = [*([self.op.name] if with_output else []), *(a.name for a in adjoints)]
        return Graph.from_ops([self.op, *adjoints] if reads_output else list(adjoints), outputs=keep)

    def _inputs(self, graph: Graph, given: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        as_is = None
        if self.target == "cuda":  # GPU arrays are read where they lie
            from neoflow.targets.cuda.interop import is_device_array as as_is
        return check_inputs(graph.free_inputs, given, self.op.name, as_is)

    def _outputs(self, out: Mapping[str, object] | None, stream: int | None = None) -> dict:
        """The executor's ``out`` (GPU arrays to write outputs into) and ``stream`` arguments (``cuda`` only)."""
        if not out and stream is None:
            return {}
        if self.target != "cuda":
            raise CompileError(
                f"out= and stream= are for GPU arrays on the cuda target (this op is compiled for {self.target})"
            )
        return {"out": out} if stream is None else {"out": out, "stream": stream}

    def run(self, inputs: Mapping[str, np.ndarray], out: object = None, stream: int | None = None) -> np.ndarray:
        """The op's output on ``inputs`` (arrays by input name: numpy, or on the ``cuda`` target
        GPU arrays, read in place); with ``out`` (a GPU array, ``cuda``) the output is written
        there and ``out`` returned; ``stream`` (``cuda``, GPU arrays only): queued on that CUDA
        stream, not waited for."""
        outputs = self._outputs(None if out is None else {self.op.name: out}, stream)
        return self._forward.run(self._inputs(self.forward_graph, inputs), **outputs)[self.op.name]

    def forward_backward(
        self, inputs: Mapping[str, np.ndarray], output_grad: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The output and the input adjoints in one run (the forward op computed once)."""
        if self._backward is None:
            raise CompileError("compiled without grad=True (or the op has no float inputs)", op=self.op.name)
        if self._both is None:
            graph = self._adjoint_graph(self.adjoints.values(), with_output=True)
            keep = [self.op.name, *(a.name for a in self.adjoints.values())]
            self._both = graph, build_executor(self.target, graph, keep, self.fusion, self.precision)
        graph, executor = self._both
        outputs = executor.run(self._inputs(graph, {**inputs, **output_grad}))
        return outputs[self.op.name], {name: outputs[a.name] for name, a in self.adjoints.items()}

    @property
    def forward_executor(self) -> object:
        """The target's executor of the forward graph (``run``'s)."""
        return self._forward

    def adjoint_executor(self, wrt: Collection[str]) -> tuple[Graph, object]:
        """The graph computing the adjoints of the inputs ``wrt`` (names with an adjoint) and the
        target's executor of it: all of them the one built with the op, a subset a kernel set of its
        own, built on first use and kept."""
        if self._backward is None:
            raise CompileError("compiled without grad=True (or the op has no float inputs)", op=self.op.name)
        if len(set(wrt)) == len(self.adjoints):
            return self.backward_graph, self._backward
        key = frozenset(wrt)
        if key not in self._partial:
            adjoints = [a for name, a in self.adjoints.items() if name in key]
            graph = self._adjoint_graph(adjoints)
            keep = [a.name for a in adjoints]
            self._partial[key] = graph, build_executor(self.target, graph, keep, self.fusion, self.precision)
        return self._partial[key]

    def backward(
        self,
        inputs: Mapping[str, np.ndarray],
        output_grad: Mapping[str, np.ndarray],
        out: Mapping[str, object] | None = None,
        wrt: Collection[str] | None = None,
        stream: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Adjoints of the op's inputs, by input name, given the inputs and the output
        adjoint (``{"d<Out>": array}``); ``out`` (``cuda``): GPU arrays, by input name, to
        write adjoints into; ``wrt``: only these inputs' adjoints (a kernel set of their own,
        compiled on first use; None: all); ``stream``: as for ``run``."""
        if self._backward is None:
            raise CompileError("compiled without grad=True (or the op has no float inputs)", op=self.op.name)
        wanted = set(self.adjoints) if wrt is None else set(wrt)
        unknown = sorted((wanted | set(out or {})) - set(self.adjoints))
        if unknown:
            raise CompileError(
                f"'{unknown[0]}' has no adjoint (inputs with one: {', '.join(self.adjoints)})", op=self.op.name
            )
        unwanted = sorted(set(out or {}) - wanted)
        if unwanted:
            raise CompileError(f"out names '{unwanted[0]}', whose adjoint wrt leaves out", op=self.op.name)
        adjoints = {name: a for name, a in self.adjoints.items() if name in wanted}
        graph, executor = self.adjoint_executor(adjoints)
        targets = self._outputs({self.adjoints[name].name: value for name, value in (out or {}).items()}, stream)
        outputs = executor.run(self._inputs(graph, {**inputs, **output_grad}), **targets)
        return {name: outputs[adjoint.name] for name, adjoint in adjoints.items()}
