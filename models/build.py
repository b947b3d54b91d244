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


def capsule_network(name: str, batch: int, size: int, channels: int, poses: tuple[int, int]) -> None:
    """Two capsule-conv layers (``neoflow`` custom nodes holding their expression; stride 1 then 2;
    ``channels`` capsule channels; poses 1 x p then 1 x q for ``poses`` = (p, q)) on 1 x ``size`` x
    ``size`` inputs, a ReLU between them, flattened into a Gemm classifier head over 10 classes."""
    first, second = poses
    nodes = [
        helper.make_node("Reshape", ["x", "caps_shape"], ["x6"]),
        helper.make_node("CapsuleConv", ["x6", "k1"], ["c1"], domain="neoflow", expression=CAPSULE.format(stride=1)),
        helper.make_node("Relu", ["c1"], ["a1"]),
        helper.make_node("CapsuleConv", ["a1", "k2"], ["c2"], domain="neoflow", expression=CAPSULE.format(stride=2)),
        helper.make_node("Flatten", ["c2"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"], transB=1),
    ]
    out = (size - 2 - 3) // 2 + 1  # after the 3x3 stride-1 and the 3x3 stride-2 layers
    inits = [
        numpy_helper.from_array(np.array([-1, 1, size, size, 1, 1], np.int64), "caps_shape"),  # any batch
        weight("k1", channels, 1, 3, 3, 1, first),
        weight("k2", channels, channels, 3, 3, first, second),
        weight("w", 10, channels * out * out * second),
        weight("b", 10),
    ]
    save(name, nodes, [value("x", batch, 1, size, size)], [value("logits", batch, 10)], inits)


def capsule() -> None:
    """The capsule network for 8x8 digits: 4 channels, poses 1x2 then 2x2, batch 32."""
    capsule_network("capsule", 32, 8, 4, (2, 2))


def capsule28() -> None:
    """A capsule network at a GPU's batch: 1x28x28 inputs, batch 64, 32 capsule channels, 1x4 poses."""
    capsule_network("capsule28", 64, 28, 32, (4, 4))


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
