"""``onnx.backend.base.Backend`` for neoflow, so onnx's own test runner drives it.

    import neoflow.backend as backend
    rep = backend.prepare(model, "CPU")
    outputs = rep.run([x])

Models run through the reference interpreter, or compiled code with ``prepare(model, target=...)``:
``cpu`` (C), ``cuda`` (CUDA on an NVIDIA GPU) or ``tensorcore`` (the tensor-core model).
A model is imported when it first runs, for the shapes of its inputs (and the
values of its integer and scalar inputs); other shapes import it again, once each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep

from neoflow import targets
from neoflow.errors import InputError
from neoflow.frontend import load_onnx, read_model
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import check_inputs, evaluate_graph
from neoflow.targets import check_target

#: Node inputs that shape the graph (scales, bounds, pads): bound as constants when given at run time.
STATIC_INPUTS = {
    ("Resize", 1),
    ("Resize", 2),
    ("Resize", 3),
    ("Upsample", 1),
    ("Clip", 1),
    ("Clip", 2),
    ("Pad", 1),
    ("Pad", 2),
    ("Pad", 3),
}


class NeoflowRep(BackendRep):
    """A prepared model: imported graphs by input shapes."""

    def __init__(self, model: onnx.ModelProto, check: bool = True, target: str = "interp") -> None:
        check_target(target)
        self.model = model
        self.check = check
        self.target = target
        self.executors: dict[int, object] = {}
        initializers = {t.name for t in model.graph.initializer}
        self.input_names = [v.name for v in model.graph.input if v.name not in initializers]
        self.output_names = [v.name for v in model.graph.output]
        self.static = {
            name for node in model.graph.node for i, name in enumerate(node.input) if (node.op_type, i) in STATIC_INPUTS
        }
        self.graphs: dict[tuple, Graph] = {}

    def graph_for(self, arrays: dict[str, np.ndarray]) -> tuple[Graph, set[str]]:
        """The graph imported for these inputs, and the inputs it binds as constants.

        Integer and scalar inputs, and inputs feeding a static slot
        (``STATIC_INPUTS``), are bound as import-time constants (shapes, axes,
        scales, bounds), so the graph is specialised to their values; other
        inputs only fix their shapes."""
        bound = {
            n: a for n, a in arrays.items() if a.ndim == 0 or np.issubdtype(a.dtype, np.integer) or n in self.static
        }
        shapes = {n: a.shape for n, a in arrays.items() if n not in bound}
        key = (tuple(sorted(shapes.items())), tuple(sorted((n, a.tobytes(), a.shape) for n, a in bound.items())))
        if key not in self.graphs:
            self.graphs[key] = load_onnx(self.model, shapes=shapes, check=self.check, constants=bound)
        return self.graphs[key], set(bound)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """Run on ``inputs`` (a list in the model's input order, a dict, or one array)."""
        if isinstance(inputs, dict):
            given = dict(inputs)
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(values) != len(self.input_names):
                raise InputError(f"the model takes {len(self.input_names)} inputs, {len(values)} given")
            given = dict(zip(self.input_names, values, strict=True))
        arrays = {name: np.asarray(value) for name, value in given.items()}
        graph, bound = self.graph_for(arrays)
        names = {onnx_name: name for name, onnx_name in graph.source_names.items()}
        feed = {names[n]: a for n, a in arrays.items() if n not in bound}
        if self.target == "interp":
            outputs = evaluate_graph(graph, feed)
        else:
            if id(graph) not in self.executors:
                self.executors[id(graph)] = targets.target(self.target).executor(graph, graph.outputs)
            outputs = self.executors[id(graph)].run(check_inputs(graph.inputs, {**graph.parameters, **feed}, "graph"))
        return tuple(outputs[names[n]] for n in self.output_names)


class NeoflowBackend(Backend):
    """The neoflow ONNX backend (CPU)."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", target: str = "interp", **kwargs: Any) -> NeoflowRep:
        """Prepare ``model`` to run on ``target`` (``interp``, the reference
        interpreter; ``cpu``, compiled C; ``cuda`` or ``tensorcore``, see docs/cuda.md)."""
        super().prepare(model, device, **kwargs)
        return NeoflowRep(read_model(model), target=target)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Sequence[np.ndarray],
        device: str = "CPU",
        outputs_info: Sequence[tuple] | None = None,
        **kwargs: Any,
    ) -> tuple[np.ndarray, ...]:
        values = [np.asarray(v) for v in inputs]
        graph_inputs = [
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for name, v in zip(node.input, values, strict=False)
            if name
        ]
        graph_outputs = [onnx.ValueInfoProto(name=name) for name in node.output if name]
        graph = helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain, opset)])
        rep = NeoflowRep(model, check=False)  # outputs have no declared types
        return rep.run([v for name, v in zip(node.input, values, strict=False) if name])

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().startswith("CPU")


prepare = NeoflowBackend.prepare
run_model = NeoflowBackend.run_model
run_node = NeoflowBackend.run_node
supports_device = NeoflowBackend.supports_device
