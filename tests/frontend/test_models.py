"""The example models in models/ import, run and agree with independent code."""

from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as tf
from onnx import numpy_helper

import neoflow

MODELS = Path(__file__).resolve().parents[2] / "models"


def params(name: str) -> dict[str, np.ndarray]:
    model = onnx.load(MODELS / name)
    return {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}


def digits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((32, 1, 8, 8)).astype(np.float32)


def test_mlp() -> None:
    graph = neoflow.load_onnx(MODELS / "mlp.onnx")
    p = params("mlp.onnx")
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    out = neoflow.evaluate(graph, {"x": x})["logits"]
    expected = np.maximum(x @ p["w1"].T + p["b1"], 0) @ p["w2"].T + p["b2"]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_cnn() -> None:
    graph = neoflow.load_onnx(MODELS / "cnn.onnx")
    p = {k: torch.from_numpy(v) for k, v in params("cnn.onnx").items()}
    x = digits()
    h = tf.max_pool2d(tf.relu(tf.conv2d(torch.from_numpy(x), p["c1"], p["cb1"], padding=1)), 2)
    h = tf.max_pool2d(tf.relu(tf.conv2d(h, p["c2"], p["cb2"], padding=1)), 2)
    expected = (h.flatten(1) @ p["w"].T + p["b"]).numpy()
    np.testing.assert_allclose(neoflow.evaluate(graph, {"x": x})["logits"], expected, rtol=1e-4, atol=1e-5)


def capsule_reference(a: torch.Tensor, b: torch.Tensor, stride: int) -> torch.Tensor:
    windows = a.unfold(2, 3, stride).unfold(3, 3, stride)  # b c p q i t r s
    return torch.einsum("bcpqitrs,kcrstj->bkpqij", windows, b)


def test_capsule_network_carries_its_custom_op_in_the_file() -> None:
    model = onnx.load(MODELS / "capsule.onnx")
    custom = [n for n in model.graph.node if n.domain == "neoflow"]
    assert custom and all(any(a.name == "expression" for a in n.attribute) for n in custom)
    graph = neoflow.load_onnx(MODELS / "capsule.onnx")  # nothing registered: the file alone suffices
    p = {k: torch.from_numpy(v) for k, v in params("capsule.onnx").items()}
    x = digits(2)
    a = torch.from_numpy(x).reshape(32, 1, 8, 8, 1, 1)
    h = capsule_reference(torch.relu(capsule_reference(a, p["k1"], 1)), p["k2"], 2)
    expected = (h.flatten(1) @ p["w"].T + p["b"]).numpy()
    np.testing.assert_allclose(neoflow.evaluate(graph, {"x": x})["logits"], expected, rtol=1e-4, atol=1e-5)


def test_four_op_onnx_matches_the_text_model() -> None:
    graph = neoflow.load_onnx(MODELS / "four_op.onnx")
    text = neoflow.graph((MODELS / "four_op.nf").read_text())
    a = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    out = neoflow.evaluate(graph, {"A": a})["F"]
    np.testing.assert_array_equal(out, neoflow.evaluate(text, {"A": a, "C": params("four_op.onnx")["C"]})["F"])


def test_register_op_for_models_without_the_expression() -> None:
    from onnx import TensorProto, helper

    node = helper.make_node("Scale3", ["x"], ["y"], domain="mydomain")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mydomain", 1)])
    neoflow.register_op("Scale3", "Out[i, j] = In0[i, j] * 3")
    loaded = neoflow.load_onnx(model)
    np.testing.assert_array_equal(neoflow.evaluate(loaded, {"x": np.ones((2, 3))})["y"], np.full((2, 3), 3.0))


def test_upsampler_with_conv_transpose_depth_to_space_and_concat() -> None:
    graph = neoflow.load_onnx(MODELS / "upsampler.onnx")
    p = {k: torch.from_numpy(v) for k, v in params("upsampler.onnx").items()}
    x = np.random.default_rng(4).standard_normal((2, 4, 5, 5)).astype(np.float32)
    tx = torch.from_numpy(x)
    up = tf.conv_transpose2d(tx, p["t"], p["tb"], stride=2, padding=1, output_padding=1)
    wide = tf.conv2d(tx, p["c"], p["cb"], padding=1).numpy()
    # DepthToSpace in DCR mode, as the ONNX spec defines it (PyTorch's pixel_shuffle is CRD)
    shuffled = wide.reshape(2, 2, 2, 2, 5, 5).transpose(0, 3, 4, 1, 5, 2).reshape(2, 2, 10, 10)
    expected = np.concatenate([up.detach().numpy(), shuffled], axis=1)
    np.testing.assert_allclose(neoflow.evaluate(graph, {"x": x})["y"], expected, rtol=1e-4, atol=1e-5)
