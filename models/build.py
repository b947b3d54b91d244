"""Build the example ONNX models with onnx.helper:  python models/build.py

Writes mlp.onnx (64-128-10), cnn.onnx (LeNet-like, 1x8x8 digits), capsule.onnx
(capsule-conv layers as neoflow custom ops + a classifier head), capsule28.onnx (the same
at 1x28x28, batch 64, for GPUs),
upsampler.onnx (ConvTranspose, DepthToSpace, Concat) and four_op.onnx (the
seed's four ops as custom ops).  Weights come from a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
RNG = np.random.default_rng(0)
OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("neoflow", 1)]


def weight(name: str, *shape: int) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    return numpy_helper.from_array((RNG.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)


def save(name: str, nodes, inputs, outputs, initializers) -> None:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="neoflow models/build.py")
    onnx.checker.check_model(model)
    onnx.save(model, HERE / f"{name}.onnx")


def value(name: str, *shape: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def mlp() -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"], transB=1),
    ]
    inits = [weight("w1", 128, 64), weight("b1", 128), weight("w2", 10, 128), weight("b2", 10)]
    save("mlp", nodes, [value("x", 32, 64)], [value("logits", 32, 10)], inits)


def cnn() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "c1", "cb1"], ["h1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h1"], ["a1"]),
        helper.make_node("MaxPool", ["a1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2", "cb2"], ["h2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h2"], ["a2"]),
        helper.make_node("MaxPool", ["a2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"], transB=1),
    ]
    inits = [
        weight("c1", 8, 1, 3, 3),
        weight("cb1", 8),
        weight("c2", 16, 8, 3, 3),
        weight("cb2", 16),
        weight("w", 10, 64),
        weight("b", 10),
    ]
    save("cnn", nodes, [value("x", 32, 1, 8, 8)], [value("logits", 32, 10)], inits)


CAPSULE = (
    "Out[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, In0[b, c, p*{stride}+r, q*{stride}+s, i, t] "
    "* In1[k, c, r, s, t, j])"
)


def capsule() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "caps_shape"], ["x6"]),
        helper.make_node("CapsuleConv", ["x6", "k1"], ["c1"], domain="neoflow", expression=CAPSULE.format(stride=1)),
        helper.make_node("Relu", ["c1"], ["a1"]),
        helper.make_node("CapsuleConv", ["a1", "k2"], ["c2"], domain="neoflow", expression=CAPSULE.format(stride=2)),
        helper.make_node("Flatten", ["c2"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"], transB=1),
    ]
    inits = [
        numpy_helper.from_array(np.array([32, 1, 8, 8, 1, 1], np.int64), "caps_shape"),
        weight("k1", 4, 1, 3, 3, 1, 2),
        weight("k2", 4, 4, 3, 3, 2, 2),
        weight("w", 10, 4 * 2 * 2 * 2),
        weight("b", 10),
    ]
    save("capsule", nodes, [value("x", 32, 1, 8, 8)], [value("logits", 32, 10)], inits)


def capsule28() -> None:
    """A capsule network at a GPU's batch: 1x28x28 inputs, batch 64, two capsule-conv layers
    (32 capsule channels, 1x4 poses; stride 1 then 2) and a classifier head."""
    nodes = [
        helper.make_node("Reshape", ["x", "caps_shape"], ["x6"]),
        helper.make_node("CapsuleConv", ["x6", "k1"], ["c1"], domain="neoflow", expression=CAPSULE.format(stride=1)),
        helper.make_node("Relu", ["c1"], ["a1"]),
        helper.make_node("CapsuleConv", ["a1", "k2"], ["c2"], domain="neoflow", expression=CAPSULE.format(stride=2)),
        helper.make_node("Flatten", ["c2"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"], transB=1),
    ]
    inits = [
        numpy_helper.from_array(np.array([64, 1, 28, 28, 1, 1], np.int64), "caps_shape"),
        weight("k1", 32, 1, 3, 3, 1, 4),
        weight("k2", 32, 32, 3, 3, 4, 4),
        weight("w", 10, 32 * 12 * 12 * 4),
        weight("b", 10),
    ]
    save("capsule28", nodes, [value("x", 64, 1, 28, 28)], [value("logits", 64, 10)], inits)


def upsampler() -> None:
    nodes = [
        helper.make_node(
            "ConvTranspose", ["x", "t", "tb"], ["up"], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]
        ),
        helper.make_node("Conv", ["x", "c", "cb"], ["wide"], pads=[1, 1, 1, 1]),
        helper.make_node("DepthToSpace", ["wide"], ["shuffled"], blocksize=2, mode="DCR"),
        helper.make_node("Concat", ["up", "shuffled"], ["y"], axis=1),
    ]
    inits = [weight("t", 4, 3, 3, 3), weight("tb", 3), weight("c", 8, 4, 3, 3), weight("cb", 8)]
    save("upsampler", nodes, [value("x", 2, 4, 5, 5)], [value("y", 2, 5, 10, 10)], inits)


def four_op() -> None:
    texts = {
        "Padding": "Out[n, c, h, w] = Select(h>2 && h<226 && w>2 && w<226, In0[n, c, h-2, w-2], 0)",
        "DilatedConv": "Out[n, k, p, q] = ReduceAdd({r, s}, In0[n, c, p*2+r*2, q*2+s*2] * In1[k, c, r, s])",
        "DepthToSpace": "Out[n, c, h, w] = In0[n, c*4+h%2*2+w%2, h//2, w//2]",
        "Concat": "Out[n, c, h, w] = Select(c<3, In0[n, c, h, w], In1[n, c-3, h, w])",
    }
    nodes = [
        helper.make_node("Padding", ["A"], ["B"], domain="neoflow", expression=texts["Padding"]),
        helper.make_node("DilatedConv", ["B", "C"], ["D"], domain="neoflow", expression=texts["DilatedConv"]),
        helper.make_node("DepthToSpace", ["D"], ["E"], domain="neoflow", expression=texts["DepthToSpace"]),
        helper.make_node("Concat", ["A", "E"], ["F"], domain="neoflow", expression=texts["Concat"]),
    ]
    graph_value_info = [value("B", 1, 3, 228, 228)]  # the padding's output shape cannot be inferred
    graph = helper.make_graph(
        nodes,
        "four_op",
        [value("A", 1, 3, 224, 224)],
        [value("F", 1, 19, 224, 224)],
        [weight("C", 64, 3, 3, 3)],
        value_info=graph_value_info,
    )
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="neoflow models/build.py")
    onnx.checker.check_model(model)
    onnx.save(model, HERE / "four_op.onnx")


if __name__ == "__main__":
    mlp()
    cnn()
    capsule()
    upsampler()
    four_op()
    capsule28()
