"""Converters checked one node at a time through neoflow.backend.run_node."""

import numpy as np
import torch
import torch.nn.functional as tf
from onnx import helper

import neoflow.backend as backend


def test_einsum() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 4, 5)).astype(np.float32)
    out = backend.run_node(helper.make_node("Einsum", ["x", "y"], ["z"], equation="bij,bjk->bik"), [x, y])[0]
    np.testing.assert_allclose(out, np.einsum("bij,bjk->bik", x, y), rtol=1e-5)
    trace = backend.run_node(helper.make_node("Einsum", ["x"], ["z"], equation="ii"), [np.eye(3, dtype=np.float32)])
    assert float(trace[0]) == 3.0


def test_resize_nearest_and_linear_match_pytorch() -> None:
    x = np.random.default_rng(1).standard_normal((1, 2, 3, 4)).astype(np.float32)
    scales = np.array([1, 1, 2, 2], np.float32)
    node = helper.make_node(
        "Resize",
        ["x", "", "scales"],
        ["y"],
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )
    nearest = backend.run_node(node, [x, np.array([], np.float32), scales], opset_version=13)[0]
    np.testing.assert_array_equal(nearest, tf.interpolate(torch.from_numpy(x), scale_factor=2, mode="nearest").numpy())
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    linear = backend.run_node(node, [x, np.array([], np.float32), scales], opset_version=13)[0]
    expected = tf.interpolate(torch.from_numpy(x), scale_factor=2, mode="bilinear", align_corners=False).numpy()
    np.testing.assert_allclose(linear, expected, rtol=1e-5, atol=1e-6)


def test_pad_modes_on_several_axes_match_numpy() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    pads = np.array([1, 2, 2, 1], np.int64)  # begins, then ends
    for mode in ("constant", "edge", "reflect", "wrap"):
        out = backend.run_node(helper.make_node("Pad", ["x", "pads"], ["y"], mode=mode), [x, pads])[0]
        np.testing.assert_array_equal(out, np.pad(x, ((1, 2), (2, 1)), mode=mode), err_msg=mode)


def test_a_castlike_of_a_constant_is_a_constant_whatever_its_type_source() -> None:
    """The dynamo exporter's unoptimised ReLU6: Clip(x, CastLike(0, x), CastLike(6, x)) — Clip's bounds
    must be constants, and a CastLike reads only its second input's type."""
    from onnx import TensorProto

    from neoflow.frontend import load_onnx

    nodes = [
        helper.make_node("Constant", [], ["low"], value_float=0.0),
        helper.make_node("Constant", [], ["high"], value_float=6.0),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("CastLike", ["low", "r"], ["low_cast"]),
        helper.make_node("CastLike", ["high", "r"], ["high_cast"]),
        helper.make_node("Clip", ["x", "low_cast", "high_cast"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "relu6",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    imported = load_onnx(model)
    assert all(op.name not in ("low_cast", "high_cast") for op in imported.ops)
    x = np.array([-1, 0.5, 3, 6.5, 9], np.float32)
    np.testing.assert_array_equal(backend.prepare(model).run([x])[0], np.clip(x, 0, 6))
