"""ONNX model → neoflow Graph."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from neoflow.errors import InputError, NeoflowError, ParseError, UnsupportedOpError
from neoflow.frontend import elementwise, indexing, linalg, nn, reduce, resize, shape  # noqa: F401  (they register converters)
from neoflow.frontend.context import ONNX_DTYPES, Model, NodeContext, to_array
from neoflow.frontend.registry import CONVERTERS, CUSTOM_EXPRESSIONS
from neoflow.ir.graph import Graph
from neoflow.ir.index import index_vars
from neoflow.ir.interpreter import evaluate_op
from neoflow.ir.op import Tensor, given_shape

CUSTOM_DOMAIN = "neoflow"


def read_model(source: str | os.PathLike | onnx.ModelProto, check: bool = True) -> onnx.ModelProto:
    """Load and (unless ``check`` is False) check a model; a missing, truncated,
    non-ONNX or invalid file is an ``InputError``."""
    if isinstance(source, onnx.ModelProto):
        model = source
    elif not isinstance(source, str | os.PathLike):
        raise InputError(
            f"a model is a path to an .onnx file, an onnx.ModelProto or a neoflow Graph, got {source!r:.60}"
        )
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise InputError(f"no such file: '{path}'")
        try:
            with open(path, "rb") as f:
                model = onnx.ModelProto.FromString(f.read())
        except (DecodeError, ValueError, RuntimeError) as err:
            raise InputError(f"'{path}' is not an ONNX model (or is truncated): {err}") from None
        if not model.graph.node and not model.graph.output:
            raise InputError(f"'{path}' is not an ONNX model (it holds no graph)")
        _load_external_data(model, os.path.dirname(os.path.abspath(path)))
    if not check:
        return model
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise InputError(f"the model fails onnx.checker: {first}") from None
    except Exception as err:  # the checker's own failures on damaged bytes (an undecodable name)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(f"the model fails onnx.checker: {type(err).__name__}: {first}") from None
    return model


def _load_external_data(model: onnx.ModelProto, directory: str) -> None:
    """Read the tensors ``model`` keeps in files beside it (``torch.onnx.export``'s default writes
    ``m.onnx.data``) from ``directory``, the model file's own, whatever the working directory."""
    stored = [t for t in model.graph.initializer if external_data_helper.uses_external_data(t)]
    if not stored:
        return
    for tensor in stored:
        location = external_data_helper.ExternalDataInfo(tensor).location
        if os.path.isabs(location) or ".." in Path(location).parts:
            raise InputError(f"tensor '{tensor.name}': its external data '{location}' lies outside the model's folder")
        if not os.path.isfile(os.path.join(directory, location)):
            raise InputError(
                f"tensor '{tensor.name}': its external data file '{os.path.join(directory, location)}' does not exist"
            )
    try:
        external_data_helper.load_external_data_for_model(model, directory)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read the model's external data from '{directory}': {err}") from None


def _input_shape(value: onnx.ValueInfoProto, given: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    if value.name in given:
        return given_shape(given[value.name], value.name)
    dims = []
    for d, dim in enumerate(value.type.tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif d == 0:
            dims.append(1)  # a dynamic batch dimension defaults to 1 unless a shape is given
        else:
            raise InputError(
                f"input '{value.name}' has dynamic dimension {d} ('{dim.dim_param}'); "
                f"give its shape (--shape {value.name}=...)"
            )
    return tuple(dims)


def load_onnx(
    source: str | os.PathLike | onnx.ModelProto,
    shapes: Mapping[str, Sequence[int]] | None = None,
    check: bool = True,
    constants: Mapping[str, np.ndarray] | None = None,
    training: bool = False,
    fold_parameters: bool = True,
) -> Graph:
    """Import an ONNX model (path or ModelProto) as a Graph of tensor-expression ops.

    Initializers become parameters (``graph.parameters``); constant
    sub-computations (shape arithmetic, ``Constant``, ``ConstantOfShape``) are
    folded at import; ``shapes`` binds input shapes by ONNX name (a dynamic batch
    dimension defaults to 1); ``constants`` binds inputs to values known at
    import (shape or axes inputs).  With ``training``, BatchNormalization uses
    batch statistics and updates its running statistics
    (``graph.state_updates``) and Dropout drops by a noise input
    (``graph.noise_inputs``).  ``fold_parameters`` False keeps every computation on an initializer
    (a ``Transpose`` of a ``Linear`` weight) an op, so that training updates what it reads: a
    model compiled to be trained is imported so.  Errors name the node and the cause."""
    model_proto = read_model(source, check)
    given = dict(shapes or {})
    opset = next((o.version for o in model_proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    read = {name for node in model_proto.graph.node for name in node.input if name}
    model = Model(
        training=training,
        consumers=read | {o.name for o in model_proto.graph.output},
        pytorch=model_proto.producer_name == "pytorch",
    )
    if not fold_parameters:
        model.unfolded = {t.name for t in model_proto.graph.initializer}
    bound = {name: np.asarray(v) for name, v in (constants or {}).items()}
    initializers = {t.name for t in model_proto.graph.initializer} | set(bound)
    values = [(t.name, to_array(t)) for t in model_proto.graph.initializer if t.name not in bound]
    for onnx_name, value in [*values, *bound.items()]:
        model.add_constant(model.name_for(onnx_name), value, source=onnx_name)
    graph_inputs = []
    for value in model_proto.graph.input:
        if value.name in initializers:
            continue
        name = model.name_for(value.name)
        elem = value.type.tensor_type.elem_type
        if elem not in ONNX_DTYPES:
            raise UnsupportedOpError(f"input '{value.name}' has an unsupported element type {elem}")
        model.tensors[name] = Tensor(name, _input_shape(value, given), ONNX_DTYPES[elem])
        graph_inputs.append(name)
    unknown = set(given) - {v.name for v in model_proto.graph.input}
    if unknown:
        raise InputError(f"--shape names '{sorted(unknown)[0]}', which is not an input of the model")
    for info in [*model_proto.graph.value_info, *model_proto.graph.output]:
        dims = info.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            model.declared[info.name] = tuple(d.dim_value for d in dims)
    for node in model_proto.graph.node:
        _convert(node, model, opset)
    outputs = [model.name_for(o.name) for o in model_proto.graph.output]
    for onnx_name, name in zip([o.name for o in model_proto.graph.output], outputs, strict=True):
        if name in model.constants and not any(op.name == name for op in model.ops):
            _materialise(model, name)
        if name not in model.tensors:
            raise InputError(f"output '{onnx_name}' is never computed")
    used = {t.name for op in model.ops for t in op.inputs}
    parameters = {n: v for n, v in model.constants.items() if n in used}
    graph = Graph.from_ops(model.ops, outputs, parameters)
    return dataclasses.replace(
        graph,
        source_names={v: k for k, v in model.names.items()},
        state_updates=dict(model.state_updates),
        noise_inputs=tuple(model.noise_inputs),
        stop_gradients=tuple(model.stop_gradients),
        batch_statistics=tuple(model.batch_statistics),
    )


def _materialise(model: Model, name: str) -> None:
    """Turn a folded constant that is a graph output into an op (a copy of a parameter)."""
    value = model.constants[name]
    source = model.add_constant(model.fresh(f"{name}_value"), value)
    v = ", ".join(index_vars(value.ndim))
    model.add_statement(f"{name}[{v}] = {source}[{v}]", value.shape)


def _convert(node: onnx.NodeProto, model: Model, opset: int) -> None:
    ctx = NodeContext(node, model, opset)
    try:
        if node.domain == CUSTOM_DOMAIN or node.op_type in CUSTOM_EXPRESSIONS:
            _custom(ctx)
            return
        if node.domain not in ("", "ai.onnx"):
            raise ctx.fail(f"op domain '{node.domain}' is not supported", UnsupportedOpError)
        convert = CONVERTERS.get(node.op_type)
        if convert is None:
            raise ctx.fail(f"op type '{node.op_type}' is not supported", UnsupportedOpError)
        before = len(model.ops)
        convert(ctx)
        _fold(ctx, before)
    except NeoflowError as err:
        raise err.with_context(node=ctx.label) from None
    except (ValueError, TypeError, KeyError, IndexError) as err:  # a malformed attribute, most likely
        raise UnsupportedOpError(
            f"{node.op_type}: bad attribute or input ({type(err).__name__}: {err})", node=ctx.label
        ) from None


# ops whose result does not depend on their input's values (Identity: a copy of an initializer is a
# parameter of its own, see ``runtime.compiled._parameter_sources``)
_VALUE_FREE = frozenset({"Shape", "Size", "Identity"})
# inputs read for their type alone: a node is constant when its other inputs are (the dynamo exporter's
# ``Clip(x, CastLike(min, x), CastLike(max, x))``)
_TYPE_ONLY_INPUTS = {"CastLike": frozenset({1})}


def _fold(ctx: NodeContext, before: int) -> None:
    """If every input of the node is a constant, evaluate its ops now and keep the values (not
    where the node computes from the values of an initializer the import must keep unfolded)."""
    type_only = _TYPE_ONLY_INPUTS.get(ctx.node.op_type, frozenset())
    inputs = [i for i in range(len(ctx.node.input)) if ctx.has_input(i) and i not in type_only]
    if not inputs or not all(ctx.constant(i) is not None for i in inputs):
        return
    if ctx.node.op_type not in _VALUE_FREE and any(ctx.node.input[i] in ctx.model.unfolded for i in inputs):
        return
    new_ops = ctx.model.ops[before:]
    del ctx.model.ops[before:]
    values = dict(ctx.model.constants)
    for op in new_ops:
        values[op.name] = evaluate_op(op, {t.name: values[t.name] for t in op.inputs})
    for k in range(len(ctx.node.output)):
        if ctx.node.output[k]:
            ctx.set_constant(k, values[ctx.output(k)])


def _custom(ctx: NodeContext) -> None:
    """A node carrying its op in the text language (attribute ``expression``), or one
    whose type was registered with ``register_op``: ``Out`` and ``In0, In1, ...``
    name its output and inputs."""
    text = ctx.attr("expression") or CUSTOM_EXPRESSIONS.get(ctx.node.op_type)
    if not text:
        raise ctx.fail(
            f"custom op '{ctx.node.op_type}' carries no 'expression' attribute and is not registered "
            f"(neoflow.register_op)",
            UnsupportedOpError,
        )
    names = {f"In{i}": ctx.input(i) for i in range(len(ctx.node.input))}
    names["Out"] = ctx.output()
    try:
        if not re.match(r"\s*Out\s*\[", text):
            raise ParseError("the expression must be one statement defining Out[...]")
        renamed = re.sub(r"\b(In\d+|Out)\b(?=\s*\[)", lambda m: names.get(m.group(1), m.group(1)), text)
        visible = {name: ctx.model.tensors[name] for key, name in names.items() if key != "Out"}
        ctx.model.add_statement(renamed, ctx.model.declared.get(ctx.node.output[0]), tensors=visible)
    except NeoflowError as err:
        raise ctx.fail(f"in the expression of custom op '{ctx.node.op_type}': {err}", type(err)) from None
