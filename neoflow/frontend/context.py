"""What an ONNX op converter sees: its node, attributes, input tensors or
constants, and a way to define its outputs as text-language statements."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from neoflow.errors import InputError, NeoflowError, ShapeError, UnsupportedOpError
from neoflow.ir import dtypes as dt
from neoflow.ir.index import index_vars
from neoflow.ir.op import Op, Tensor
from neoflow.ir.text import build_statement

ONNX_DTYPES: dict[int, str] = {
    getattr(onnx.TensorProto, name.upper()): name for name in dt.DTYPES if name not in ("float32", "float64")
} | {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}
_RESERVED = re.compile(
    r"^([ikr]\d+|true|false|inf|nan|tensor|Select|Reduce\w*|exp|log|sqrt|tanh|sigmoid|abs|pow|"
    r"max|min|erf|float\w+|u?int\d+|bfloat16|bool)$"
)


def broadcast_index(shape: Sequence[int], out_shape: Sequence[int], names: Sequence[str]) -> str:
    """Indices reading a tensor of ``shape`` broadcast (numpy rules) to ``out_shape``."""
    offset = len(out_shape) - len(shape)
    return ", ".join(
        "0" if size == 1 and out_shape[offset + d] != 1 else names[offset + d] for d, size in enumerate(shape)
    )


@dataclass
class Model:
    """The state of an import: tensors by (sanitized) name, constant values, ops."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # ONNX name -> neoflow name
    ops: list[Op] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    declared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ONNX value_info shapes
    training: bool = False  # BatchNormalization uses batch statistics, Dropout drops
    state_updates: dict[str, str] = field(default_factory=dict)  # parameter -> tensor with its next value
    noise_inputs: list[str] = field(default_factory=list)  # inputs filled with uniform noise per run
    stop_gradients: list[str] = field(default_factory=list)  # tensors autodiff treats as constants
    batch_statistics: list[str] = field(default_factory=list)  # means over the batch (BatchNorm's in training)
    consumers: set[str] = field(default_factory=set)  # ONNX names some node or the graph's outputs read
    pytorch: bool = False  # written by PyTorch's exporter (producer_name "pytorch"): its layers' conventions
    unfolded: set[str] = field(default_factory=set)  # ONNX initializers whose values no node is folded from

    def name_for(self, onnx_name: str) -> str:
        """The neoflow tensor name for an ONNX value name (a valid, unique identifier)."""
        if onnx_name not in self.names:
            base = re.sub(r"\W", "_", onnx_name) or "t"
            if base[0].isdigit() or base.startswith("_"):
                base = "t" + base
            if _RESERVED.match(base):
                base += "_"
            name, n = base, 1
            while name in self.taken:
                n += 1
                name = f"{base}_{n}"
            self.taken.add(name)
            self.names[onnx_name] = name
        return self.names[onnx_name]

    def add_constant(self, name: str, value: np.ndarray, source: str | None = None) -> str:
        """Register ``name`` as an import-time constant tensor holding ``value``."""
        value = np.asarray(value)
        if str(value.dtype) not in dt.DTYPES:
            raise UnsupportedOpError(f"tensor '{source or name}' has unsupported dtype {value.dtype}")
        self.constants[name] = value
        self.tensors[name] = Tensor(name, tuple(value.shape), str(value.dtype))
        return name

    def add_statement(
        self,
        text: str,
        out_shape: Sequence[int] | None = None,
        dtype: str | None = None,
        tensors: Mapping[str, Tensor] | None = None,
    ) -> Op:
        """Build the one statement in ``text`` over ``tensors`` (default: all so far) and add its op."""
        op = build_statement(text, self.tensors if tensors is None else tensors, out_shape, dtype)
        self.ops.append(op)
        self.tensors[op.name] = op.output
        return op

    def fresh(self, hint: str) -> str:
        """A new internal tensor name."""
        return self.name_for(f"{hint}__{len(self.names)}")


class NodeContext:
    """One node being converted."""

    def __init__(self, node: onnx.NodeProto, model: Model, opset: int) -> None:
        self.node = node
        self.model = model
        self.opset = opset
        self.attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    @property
    def label(self) -> str:
        return self.node.name or f"{self.node.op_type}({', '.join(self.node.output)})"

    def fail(self, message: str, cls: type[NeoflowError] = ShapeError) -> NeoflowError:
        return cls(message, node=self.label)

    def attr(self, name: str, default: object = None) -> object:
        value = self.attributes.get(name, default)
        if isinstance(value, bytes):
            return value.decode()
        return value

    def has_input(self, i: int) -> bool:
        return i < len(self.node.input) and self.node.input[i] != ""

    def input(self, i: int) -> str:
        """The neoflow name of input ``i`` (constants become parameter tensors)."""
        if not self.has_input(i):
            raise self.fail(f"{self.node.op_type} needs input {i}")
        onnx_name = self.node.input[i]
        name = self.model.name_for(onnx_name)
        if name not in self.model.tensors:
            raise self.fail(f"input '{onnx_name}' is not defined before this node")
        return name

    def constant(self, i: int) -> np.ndarray | None:
        """The value of input ``i`` if it is known at import time."""
        if not self.has_input(i):
            return None
        return self.model.constants.get(self.model.name_for(self.node.input[i]))

    def require_constant(self, i: int, what: str) -> np.ndarray:
        value = self.constant(i)
        if value is None:
            raise self.fail(f"{what} (input {i}) must be a constant", UnsupportedOpError)
        return value

    def tensor(self, i: int) -> Tensor:
        return self.model.tensors[self.input(i)]

    def shape(self, i: int) -> tuple[int, ...]:
        return self.tensor(i).shape

    def output(self, k: int = 0) -> str:
        return self.model.name_for(self.node.output[k])

    def set_constant(self, k: int, value: np.ndarray) -> None:
        """Define output ``k`` as an import-time constant."""
        self.model.add_constant(self.output(k), value)

    def constant_table(self, hint: str, values: np.ndarray, dtype: str) -> str:
        """A new constant tensor (an index or weight table this node reads); returns its name."""
        return self.model.add_constant(self.model.fresh(f"{self.output()}_{hint}"), np.asarray(values).astype(dtype))

    def define(
        self,
        body: str | Callable[[list[str]], str],
        shape: Sequence[int],
        k: int = 0,
        dtype: str | None = None,
        name: str | None = None,
    ) -> str:
        """Define output ``k`` (or an internal tensor ``name``) as ``body`` over the
        index variables ``i0, i1, ...`` of ``shape``; returns its name."""
        out = name or self.output(k)
        if any(d < 0 for d in shape):
            raise self.fail(f"its output '{out}' would have shape {list(shape)}: a negative dimension")
        names = index_vars(len(shape))
        text = body(names) if callable(body) else body
        self.model.add_statement(f"{out}[{', '.join(names)}] = {text}", shape, dtype)
        return out

    def elementwise(self, template: str, inputs: Sequence[int] | None = None, dtype: str | None = None) -> str:
        """Define output 0 as ``template`` (``{0}``, ``{1}`` ... stand for the inputs'
        elements) with numpy broadcasting of the inputs."""
        idx = list(range(len(self.node.input))) if inputs is None else list(inputs)
        shapes = [self.shape(i) for i in idx]
        try:
            out_shape = tuple(np.broadcast_shapes(*shapes)) if shapes else ()
        except ValueError:
            raise self.fail(f"input shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast") from None
        names = index_vars(len(out_shape))
        reads = []
        for i, shape in zip(idx, shapes, strict=True):
            reads.append(f"{self.input(i)}[{broadcast_index(shape, out_shape, names)}]")
        return self.define(template.format(*reads), out_shape, dtype=dtype)


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """An ONNX tensor as a numpy array; a data type ONNX does not have, or data that does not fill
    the tensor's dims, is an ``InputError`` naming the tensor."""
    if tensor.data_type not in onnx.TensorProto.DataType.values():
        raise InputError(f"tensor '{tensor.name}' has data type {tensor.data_type}, which is no ONNX data type")
    if any(d < 0 for d in tensor.dims):
        raise InputError(f"tensor '{tensor.name}' has dims {list(tensor.dims)}: a negative dimension")
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError) as err:
        kind = onnx.TensorProto.DataType.Name(tensor.data_type)
        raise InputError(
            f"tensor '{tensor.name}': its data does not match its data type {kind} and dims {list(tensor.dims)} ({err})"
        ) from None
