"""Generate onnx's node test data (the wheel does not ship it) with onnx's own
case generators, in the layout onnx's backend test runner reads, cached per
onnx version under $NEOFLOW_CACHE_DIR (default ~/.cache/neoflow)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import onnx
from onnx import numpy_helper

# The op types issue 4 lists; node tests of these count towards the pass rate.
OP_TYPES = [
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "Einsum",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Neg",
    "Abs",
    "Sqrt",
    "Reciprocal",
    "Exp",
    "Log",
    "Tanh",
    "Sigmoid",
    "HardSigmoid",
    "Relu",
    "LeakyRelu",
    "PRelu",
    "Elu",
    "Selu",
    "Softplus",
    "Erf",
    "Gelu",
    "Clip",
    "Min",
    "Max",
    "Sum",
    "Mean",
    "Where",
    "Equal",
    "Less",
    "Greater",
    "Not",
    "And",
    "Or",
    "Cast",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "LRN",
    "BatchNormalization",
    "LayerNormalization",
    "InstanceNormalization",
    "Softmax",
    "LogSoftmax",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL2",
    "ReduceSumSquare",
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "Pad",
    "Expand",
    "Tile",
    "DepthToSpace",
    "SpaceToDepth",
    "Resize",
    "Upsample",
    "Gather",
    "Identity",
    "Dropout",
]


def node_data_dir() -> Path:
    """The directory holding ``node/<case>/model.onnx`` and its data sets (created once)."""
    root = Path(os.environ.get("NEOFLOW_CACHE_DIR", Path.home() / ".cache" / "neoflow"))
    target = root / f"onnx-{onnx.__version__}-data"
    done = target / "node" / ".complete"
    if done.exists():
        return target
    from onnx.backend.test.case import node

    for case in node.collect_testcases(None):
        out = target / "node" / case.name
        for i, (inputs, outputs) in enumerate(case.data_sets or []):
            data = out / f"test_data_set_{i}"
            data.mkdir(parents=True, exist_ok=True)
            for prefix, values, infos in (
                ("input", inputs, case.model.graph.input),
                ("output", outputs, case.model.graph.output),
            ):
                for j, value in enumerate(values):
                    if not infos[j].type.HasField("tensor_type"):
                        continue
                    proto = (
                        value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(value, infos[j].name)
                    )
                    (data / f"{prefix}_{j}.pb").write_bytes(proto.SerializeToString())
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.onnx").write_bytes(case.model.SerializeToString())
    done.touch()
    return target


def op_type_of(case_dir: Path) -> str:
    """The op type a node test exercises: its model's node, or for an ``_expanded``
    test (the op's function body spelled out) the op of the test it expands."""
    base = re.sub(r"_expanded(_ver\d+)?$", "", case_dir.name)
    if base != case_dir.name and (case_dir.parent / base).is_dir():
        case_dir = case_dir.parent / base
    model = onnx.load(case_dir / "model.onnx", load_external_data=False)
    return model.graph.node[-1].op_type if model.graph.node else ""
