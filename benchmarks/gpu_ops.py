"""The operator suite of the AMOS/FlexTensor evaluation as tensor expressions, each with its PyTorch
equivalent (cuBLAS/cuDNN), for ``benchmarks.gpu``: forward and backward of every operator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Operator:
    """``text`` (one statement, output ``Y``), input ``shapes``, ``torch(inputs) -> Y`` on torch
    tensors, and the output shape where the reads do not bound it (padding, transposed convs)."""

    name: str
    text: str
    shapes: dict[str, tuple[int, ...]]
    torch: Callable
    out_shape: tuple[int, ...] | None = None


def _f():
    import torch.nn.functional as F

    return F


def operators() -> list[Operator]:
    """GEMV, GEMM, bilinear, conv1d, transposed conv1d, conv2d, transposed conv2d, conv3d,
    transposed conv3d, grouped, depthwise and dilated conv2d, at sizes a layer of a CNN has."""
    F = _f()
    pad2 = "Select(h + r >= 1 && h + r <= {H} && w + s >= 1 && w + s <= {W}, X[n, c, h + r - 1, w + s - 1], 0)"
    return [
        Operator(
            "gemv",
            "Y[i] = ReduceAdd({k}, A[i, k] * X[k])",
            {"A": (4096, 4096), "X": (4096,)},
            lambda t: t["A"] @ t["X"],
        ),
        Operator(
            "gemm",
            "Y[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])",
            {"A": (1024, 1024), "B": (1024, 1024)},
            lambda t: t["A"] @ t["B"],
        ),
        Operator(
            "bilinear",
            "Y[n, o] = ReduceAdd({i, j}, X1[n, i] * W[o, i, j] * X2[n, j])",
            {"X1": (128, 64), "W": (64, 64, 64), "X2": (128, 64)},
            lambda t: F.bilinear(t["X1"], t["X2"], t["W"]),
        ),
        Operator(
            "conv1d",
            "Y[n, k, l] = ReduceAdd({c, r}, X[n, c, l + r] * W[k, c, r])",
            {"X": (32, 64, 258), "W": (64, 64, 3)},
            lambda t: F.conv1d(t["X"], t["W"]),
        ),
        Operator(
            "conv1d_transposed",
            "Y[n, k, l] = ReduceAdd({c, r}, Select((l - r) % 2 == 0 && (l - r) // 2 >= 0 && (l - r) // 2 < 128, "
            "X[n, c, (l - r) // 2], 0) * W[c, k, r])",
            {"X": (32, 64, 128), "W": (64, 64, 4)},
            lambda t: F.conv_transpose1d(t["X"], t["W"], stride=2),
            (32, 64, 258),
        ),
        Operator(
            "conv2d",
            "Y[n, k, h, w] = ReduceAdd({c, r, s}, " + pad2.format(H=28, W=28) + " * K[k, c, r, s])",
            {"X": (32, 64, 28, 28), "K": (64, 64, 3, 3)},
            lambda t: F.conv2d(t["X"], t["K"], padding=1),
            (32, 64, 28, 28),
        ),
        Operator(
            "conv2d_transposed",
            "Y[n, k, h, w] = ReduceAdd({c, r, s}, Select((h - r) % 2 == 0 && (w - s) % 2 == 0 && (h - r) // 2 >= 0 "
            "&& (h - r) // 2 < 14 && (w - s) // 2 >= 0 && (w - s) // 2 < 14, X[n, c, (h - r) // 2, (w - s) // 2], 0)"
            " * K[c, k, r, s])",
            {"X": (32, 64, 14, 14), "K": (64, 64, 4, 4)},
            lambda t: F.conv_transpose2d(t["X"], t["K"], stride=2),
            (32, 64, 30, 30),
        ),
        Operator(
            "conv3d",
            "Y[n, k, d, h, w] = ReduceAdd({c, q, r, s}, X[n, c, d + q, h + r, w + s] * K[k, c, q, r, s])",
            {"X": (8, 32, 18, 18, 18), "K": (32, 32, 3, 3, 3)},
            lambda t: F.conv3d(t["X"], t["K"]),
        ),
        Operator(
            "conv3d_transposed",
            "Y[n, k, d, h, w] = ReduceAdd({c, q, r, s}, Select((d - q) % 2 == 0 && (h - r) % 2 == 0 && "
            "(w - s) % 2 == 0 && (d - q) // 2 >= 0 && (d - q) // 2 < 8 && (h - r) // 2 >= 0 && (h - r) // 2 < 8 && "
            "(w - s) // 2 >= 0 && (w - s) // 2 < 8, X[n, c, (d - q) // 2, (h - r) // 2, (w - s) // 2], 0) * "
            "K[c, k, q, r, s])",
            {"X": (8, 32, 8, 8, 8), "K": (32, 32, 4, 4, 4)},
            lambda t: F.conv_transpose3d(t["X"], t["K"], stride=2),
            (8, 32, 18, 18, 18),
        ),
        Operator(
            "grouped_conv2d",
            "Y[n, g, k, h, w] = ReduceAdd({c, r, s}, Select(h + r >= 1 && h + r <= 28 && w + s >= 1 && w + s <= 28, "
            "X[n, g, c, h + r - 1, w + s - 1], 0) * K[g, k, c, r, s])",
            {"X": (32, 4, 32, 28, 28), "K": (4, 32, 32, 3, 3)},
            lambda t: F.conv2d(
                t["X"].reshape(32, 128, 28, 28), t["K"].reshape(128, 32, 3, 3), padding=1, groups=4
            ).reshape(32, 4, 32, 28, 28),
            (32, 4, 32, 28, 28),
        ),
        Operator(
            "depthwise_conv2d",
            "Y[n, c, h, w] = ReduceAdd({r, s}, " + pad2.format(H=56, W=56) + " * K[c, r, s])",
            {"X": (32, 64, 56, 56), "K": (64, 3, 3)},
            lambda t: F.conv2d(t["X"], t["K"].unsqueeze(1), padding=1, groups=64),
            (32, 64, 56, 56),
        ),
        Operator(
            "dilated_conv2d",
            "Y[n, k, h, w] = ReduceAdd({c, r, s}, X[n, c, h + 2 * r, w + 2 * s] * K[k, c, r, s])",
            {"X": (32, 64, 32, 32), "K": (64, 64, 3, 3)},
            lambda t: F.conv2d(t["X"], t["K"], dilation=2),
        ),
    ]
