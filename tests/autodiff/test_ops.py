"""Adjoints of common operators, written as tensor expressions: finite differences
(float64, relative error < 1e-6), PyTorch autograd where it has the op, and every
adjoint a gather with zero waste."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

import neoflow
from neoflow.autodiff import grad
from neoflow.ir.expr import Reduce
from neoflow.ir.printer import to_text

from .gradcheck import adjoints, check


def conv2d_text(stride: int, pad: int, dilation: int, groups: int, channels: int, kernels: int) -> str:
    cg, kg = channels // groups, kernels // groups
    h = f"p*{stride} + r*{dilation} - {pad}"
    w = f"q*{stride} + s*{dilation} - {pad}"
    read = f"X[n, k//{kg}*{cg} + c, {h}, {w}]"
    if pad:
        read = f"Select({h} >= 0 && {h} < 6 && {w} >= 0 && {w} < 6, {read}, 0)"
    return f"Y[n, k, p, q] = ReduceAdd({{c, r, s}}, {read} * W[k, c, r, s])"


CONV_CASES = list(itertools.product([1, 2, 3], [0, 1], [1, 2], [1, 2, 4]))


@pytest.mark.parametrize(("stride", "pad", "dilation", "groups"), CONV_CASES)
def test_conv2d(stride: int, pad: int, dilation: int, groups: int) -> None:
    channels = kernels = 4
    text = conv2d_text(stride, pad, dilation, groups, channels, kernels)
    out = (6 + 2 * pad - dilation * 2 - 1) // stride + 1
    check(
        text,
        {"X": (1, channels, 6, 6), "W": (kernels, channels // groups, 3, 3), "Y": (1, kernels, out, out)},
        lambda X, W: tf.conv2d(X, W, stride=stride, padding=pad, dilation=dilation, groups=groups),
    )


def test_a_grouped_conv_s_input_adjoint_solves_for_the_channel_within_its_group() -> None:
    # X[n, k//4*4 + c, ...]: the dX point's channel z fixes c = z % 4 (its extent is the group's 4), so
    # the adjoint sums over the group's kernels and the window, not over c under a condition on c
    shapes = {"X": (1, 16, 6, 6), "W": (16, 4, 3, 3), "Y": (1, 16, 6, 6)}
    reduce = grad(neoflow.op(conv2d_text(1, 1, 1, 4, 16, 16), shapes=shapes))["X"].body
    assert isinstance(reduce, Reduce) and len(reduce.axes) == 3 and "c" not in reduce.axes
    assert reduce.where is None or "%" not in to_text(reduce.where)  # no lattice condition
    assert "%4" in to_text(reduce.body)  # W's channel: the dX point's, modulo the group's 4


def test_conv1d_strided() -> None:
    check(
        "Y[n, k, p] = ReduceAdd({c, r}, X[n, c, 2*p + r] * W[k, c, r])",
        {"X": (2, 3, 9), "W": (2, 3, 3)},
        lambda X, W: tf.conv1d(X, W, stride=2),
    )


def test_conv3d() -> None:
    check(
        "Y[n, k, d, p, q] = ReduceAdd({c, t, r, s}, X[n, c, d + t, 2*p + r, q + s] * W[k, c, t, r, s])",
        {"X": (1, 2, 4, 5, 4), "W": (2, 2, 2, 3, 2)},
        lambda X, W: tf.conv3d(X, W, stride=(1, 2, 1)),
    )


def test_transposed_conv() -> None:
    # ConvTranspose, stride 2, padding 1: Y[p] = sum_r X[(p + 1 - r)/2] W[r] where the division is exact
    text = (
        "Y[n, k, p, q] = ReduceAdd({c, r, s | (p + 1 - r)%2 == 0 && (q + 1 - s)%2 == 0 && p + 1 - r >= 0 && "
        "(p + 1 - r)//2 < 4 && q + 1 - s >= 0 && (q + 1 - s)//2 < 4}, "
        "X[n, c, (p + 1 - r)//2, (q + 1 - s)//2] * W[c, k, r, s])"
    )
    check(
        text,
        {"X": (1, 2, 4, 4), "W": (2, 3, 3, 3), "Y": (1, 3, 7, 7)},
        lambda X, W: tf.conv_transpose2d(X, W, stride=2, padding=1),
    )


def test_matmul_batched_and_gemm() -> None:
    check("Y[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (3, 4), "B": (4, 2)}, lambda A, B: A @ B)
    check("Y[b, i, j] = ReduceAdd({k}, A[b, i, k] * B[b, k, j])", {"A": (2, 3, 4), "B": (2, 4, 2)}, lambda A, B: A @ B)
    check(
        "Y[i, j] = 0.5 * ReduceAdd({k}, A[k, i] * B[j, k]) + 2.0 * C[j]",
        {"A": (4, 3), "B": (2, 4), "C": (2,)},
        lambda A, B, C: 0.5 * A.T @ B.T + 2.0 * C,
    )


def test_max_and_average_pooling_with_overlap() -> None:
    check(
        "Y[n, c, p, q] = ReduceMax({r: 3, s: 3}, X[n, c, 2*p + r, 2*q + s])",
        {"X": (1, 2, 7, 7)},
        lambda X: tf.max_pool2d(X, 3, stride=2),
    )
    check(
        "Y[n, c, p, q] = ReduceAdd({r: 3, s: 3}, X[n, c, 2*p + r, 2*q + s]) / 9",
        {"X": (1, 2, 7, 7)},
        lambda X: tf.avg_pool2d(X, 3, stride=2),
    )
    check(
        "Y[n, c, p, q] = ReduceMax({r: 2, s: 2}, X[n, c, 2*p + r, 2*q + s])",
        {"X": (1, 2, 6, 6)},
        lambda X: tf.max_pool2d(X, 2),
    )


def test_global_pooling() -> None:
    check("Y[n, c] = ReduceAdd({h, w}, X[n, c, h, w]) / 20", {"X": (2, 3, 4, 5)}, lambda X: X.mean(dim=(2, 3)))
    check("Y[n, c] = ReduceMax({h, w}, X[n, c, h, w])", {"X": (2, 3, 4, 5)}, lambda X: X.amax(dim=(2, 3)))


def test_softmax_and_log_softmax() -> None:
    check(
        "Y[i, j] = exp(X[i, j] - ReduceMax({m}, X[i, m])) / ReduceAdd({k}, exp(X[i, k] - ReduceMax({l}, X[i, l])))",
        {"X": (3, 4)},
        lambda X: torch.softmax(X, dim=1),
    )
    check(
        "Y[i, j] = X[i, j] - ReduceMax({m}, X[i, m]) - log(ReduceAdd({k}, exp(X[i, k] - ReduceMax({l}, X[i, l]))))",
        {"X": (3, 4)},
        lambda X: torch.log_softmax(X, dim=1),
    )


def test_layer_norm() -> None:
    mean = "ReduceAdd({k}, X[i, k]) / 5"
    var = "ReduceAdd({l}, (X[i, l] - ReduceAdd({m}, X[i, m]) / 5) * (X[i, l] - ReduceAdd({m}, X[i, m]) / 5)) / 5"
    check(
        f"Y[i, j] = (X[i, j] - {mean}) / sqrt({var} + 1e-5) * G[j] + B[j]",
        {"X": (3, 5), "G": (5,), "B": (5,)},
        lambda X, G, B: tf.layer_norm(X, (5,), G, B, eps=1e-5),
    )


def test_batch_norm_training_mode() -> None:
    mean = "ReduceAdd({a, h, w}, X[a, c, h, w]) / 18"
    centred = "(X[b, c, u, v] - ReduceAdd({e, f, g}, X[e, c, f, g]) / 18)"
    var = f"ReduceAdd({{b, u, v}}, {centred} * {centred}) / 18"
    check(
        f"Y[n, c, p, q] = (X[n, c, p, q] - {mean}) / sqrt({var} + 1e-5) * G[c] + B[c]",
        {"X": (2, 2, 3, 3), "G": (2,), "B": (2,)},
        lambda X, G, B: tf.batch_norm(X, None, None, G, B, training=True, eps=1e-5),
    )


def test_depth_to_space_and_space_to_depth() -> None:
    check("E[n, c, h, w] = D[n, c*4 + h%2*2 + w%2, h//2, w//2]", {"D": (1, 8, 3, 3)}, lambda D: tf.pixel_shuffle(D, 2))
    check(
        "Y[n, c, h, w] = X[n, c//4, h*2 + c%4//2, w*2 + c%2]", {"X": (1, 2, 6, 4)}, lambda X: tf.pixel_unshuffle(X, 2)
    )


def test_concat_split_and_slices() -> None:
    check(
        "F[n, c, h, w] = Select(c < 3, A[n, c, h, w], E[n, c - 3, h, w])",
        {"A": (1, 3, 2, 2), "E": (1, 2, 2, 2)},
        lambda A, E: torch.cat([A, E], dim=1),
    )
    check("Y[i, j] = X[i + 2, j]", {"X": (5, 3), "Y": (3, 3)}, lambda X: X[2:])
    check("Y[i] = X[2*i + 1]", {"X": (8,)}, lambda X: X[1::2])
    check("Y[i] = X[7 - 3*i]", {"X": (8,), "Y": (3,)}, lambda X: X.flip(0)[::3])


def test_pads() -> None:
    check(
        "Y[i, j] = Select(j >= 2 && j < 6, X[i, j - 2], 0.5)",
        {"X": (2, 4), "Y": (2, 7)},
        lambda X: tf.pad(X, (2, 1), value=0.5),
    )
    check(
        "Y[i, j] = Select(j < 2, X[i, 0], Select(j >= 6, X[i, 3], X[i, j - 2]))",
        {"X": (2, 4), "Y": (2, 7)},
        lambda X: tf.pad(X[None], (2, 1), mode="replicate")[0],
    )
    check(
        "Y[i, j] = Select(j < 2, X[i, 2 - j], Select(j >= 6, X[i, 8 - j], X[i, j - 2]))",
        {"X": (2, 4), "Y": (2, 7)},
        lambda X: tf.pad(X[None], (2, 1), mode="reflect")[0],
    )


def test_transpose_reshape_flatten() -> None:
    check("Y[a, b, c] = X[c, a, b]", {"X": (2, 3, 4)}, lambda X: X.permute(1, 2, 0))
    check("Y[i] = X[i//4, i%4]", {"X": (3, 4), "Y": (12,)}, lambda X: X.flatten())
    check("Y[a, b] = X[(6*a + b)//4, (6*a + b)%4]", {"X": (3, 4), "Y": (2, 6)}, lambda X: X.reshape(2, 6))


def test_a_flattenings_adjoint_reads_each_gradient_once_without_a_masked_sum() -> None:
    # flattening (2, 3, 5, 4, 1, 2) to (2, 120), indexed as the ONNX Reshape converter writes it: solving
    # the index map leaves sums over the residues of the flat index, each pinned to one value by a lattice
    # condition (capsule28's grad_c2 summed 576 x 48 masked terms a point before they were pinned)
    text = "Y[n, k] = X[n, k//40, k//8%5, k//2%4, 0, k%2]"
    shapes = {"X": (2, 3, 5, 4, 1, 2), "Y": (2, 120)}
    check(text, shapes, lambda X: X.flatten(1))
    (adjoint,) = grad(neoflow.op(text, shapes=shapes)).values()
    assert not any(isinstance(node, Reduce) for node in adjoint.body.walk()), adjoint


def test_broadcast_elementwise() -> None:
    check(
        "Y[i, j] = tanh(X[i, j]) * B[j] + sigmoid(C[i]) - max(X[i, j], 0) / (1 + abs(B[j]))",
        {"X": (3, 4), "B": (4,), "C": (3,)},
        lambda X, B, C: torch.tanh(X) * B + torch.sigmoid(C)[:, None] - torch.relu(X) / (1 + B.abs()),
    )
    check(
        "Y[i, j] = pow(X[i, j], 3) + log(P[j]) * sqrt(P[j]) + exp(-X[i, j])",
        {"X": (2, 3), "P": (3,)},
        lambda X, P: X**3 + torch.log(P) * torch.sqrt(P) + torch.exp(-X),
        positive=("P",),
    )


def test_reductions() -> None:
    check("Y[i] = ReduceAdd({j}, X[i, j])", {"X": (3, 4)}, lambda X: X.sum(1))
    check("Y[i] = ReduceAdd({j}, X[i, j]) / 4", {"X": (3, 4)}, lambda X: X.mean(1))
    check("Y[i] = ReduceMax({j}, X[i, j])", {"X": (3, 4)}, lambda X: X.amax(1))
    check("Y[i] = ReduceMin({j}, X[i, j])", {"X": (3, 4)}, lambda X: X.amin(1))
    check("Y[i] = ReduceMul({j}, X[i, j])", {"X": (3, 4)}, lambda X: X.prod(1))


def test_repeated_reads_add_up() -> None:
    check("Y[i, j] = X[i, j] * X[i, j] + X[j, i] + X[i, i]", {"X": (3, 3)}, lambda X: X * X + X.T + X.diag()[:, None])


def test_erf() -> None:
    check("Y[i] = erf(X[i]) * X[i]", {"X": (5,)}, lambda X: torch.erf(X) * X)


@pytest.mark.parametrize(
    ("text", "reference"),
    [
        ("Y[i, j] = max(X[i, j], 0)", lambda X: torch.relu(X)),
        ("Y[i, j] = max(0.5, X[i, j])", lambda X: torch.clamp(X, min=0.5)),
        ("Y[i, j] = min(X[i, j], 0.5)", lambda X: torch.clamp(X, max=0.5)),
        ("Y[i, j] = tanh(X[i, j])", lambda X: torch.tanh(X)),
        ("Y[i, j] = sigmoid(X[i, j])", lambda X: torch.sigmoid(X)),
        ("Y[i, j] = exp(X[i, j])", lambda X: torch.exp(X)),
    ],
)
def test_an_activations_adjoint_reads_its_output_not_its_input(text: str, reference) -> None:
    # as frameworks save an activation's output for its backward: the input is left one reader (the
    # activation itself), which a fusion plan can then finish in the producing conv's epilogue
    op = neoflow.op(text, shapes={"X": (3, 4)})
    assert [t.name for t in grad(op)["X"].inputs] == ["dY", "Y"]
    check(text, {"X": (3, 4)}, reference)


@pytest.mark.parametrize(
    ("text", "reference"),
    [
        ("Y[i, j] = max(X[i, j], 0)", torch.relu),
        ("Y[i, j] = 3 * max(X[i, j], 0) + X[i, j]", lambda X: 3 * torch.relu(X) + X),
    ],
)
def test_a_clamp_gives_its_ties_to_the_constant(text: str, reference) -> None:
    # relu'(0) = 0 as in PyTorch and JAX (where the output is read: max(x, 0) > 0 exactly where x > 0),
    # and inside a larger expression too
    x = np.array([[-1.0, 0.0, 2.0], [0.5, 0.0, -0.5]])
    got = adjoints(neoflow.op(text, shapes={"X": (2, 3)}), {"X": x}, np.ones((2, 3)))["X"]
    xt = torch.tensor(x, requires_grad=True)
    reference(xt).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())
