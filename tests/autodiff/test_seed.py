"""The seed's ops, its running example and its four-op graph, differentiated."""

import numpy as np
import torch
import torch.nn.functional as tf

import neoflow
from neoflow.autodiff import grad

from .gradcheck import adjoints, check, relative_error


def capsule(stride: int):
    text = (
        f"C[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, A[b, c, p*{stride}+r, q*{stride}+s, i, t] * "
        f"B[k, c, r, s, t, j])"
    )

    def torch_fn(A, B):
        windows = A.unfold(2, 3, stride).unfold(3, 3, stride)  # b c p q i t r s
        return torch.einsum("bcpqitrs,kcrstj->bkpqij", windows, B)

    return text, torch_fn


def test_capsule_conv_stride_1_and_2() -> None:
    for stride in (1, 2):
        text, fn = capsule(stride)
        check(text, {"A": (1, 2, 5, 5, 2, 2), "B": (2, 2, 3, 3, 2, 2)}, fn)


def test_seed_running_example_prints_in_the_seed_shape() -> None:
    op = check(
        "Out[b, k, p, q] = ReduceAdd({c, r, s}, In[b, c, p*2+r, q/2+s] * Weight[k, c, r, s])",
        {"In": (1, 2, 7, 5), "Weight": (2, 2, 3, 3)},
        lambda In, Weight: tf.conv2d(In, Weight, stride=(2, 1)).repeat_interleave(2, dim=3),
    )
    d_in = grad(op, "In")["In"]
    assert str(d_in) == (
        "dIn[b, c, z3, z4] = ReduceAdd({k, r, s, q_mod2: 2 | (z3 - r)%2 == 0 && (z3 - r)//2 >= 0 && "
        "(z3 - r)//2 < 3 && z4 - s >= 0 && z4 - s < 3}, dOut[b, k, (z3 - r)//2, q_mod2 + 2*z4 - 2*s] * "
        "Weight[k, c, r, s])"
    )
    assert d_in.info.new_axes == (("k", 2), ("r", 3), ("s", 3), ("q_mod2", 2))


def test_stride_one_conv_input_adjoint_is_a_flipped_conv_over_a_tight_window() -> None:
    op = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
        shapes={"X": (1, 2, 6, 6), "W": (3, 2, 3, 3)},
    )
    assert str(grad(op, "X")["X"]) == (
        "dX[n, c, z3, z4] = ReduceAdd({k, r, s | z3 - r >= 0 && z3 - r < 4 && z4 - s >= 0 && z4 - s < 4}, "
        "dY[n, k, z3 - r, z4 - s] * W[k, c, r, s])"
    )


def test_strided_input_adjoint_enumerates_only_contributing_taps() -> None:
    op = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, 2*p + r, 2*q + s] * W[k, c, r, s])",
        shapes={"X": (1, 2, 9, 9), "W": (3, 2, 3, 3)},
    )
    d_x = grad(op, "X")["X"]
    assert d_x.info.waste == 0.0
    assert "(z3 - r)%2 == 0" in str(d_x) and "(z4 - s)%2 == 0" in str(d_x)


SMALL_SEED = [
    (
        "B[n, c, h, w] = Select(h>2 && h<10 && w>2 && w<10, A[n, c, h-2, w-2], 0)",
        {"A": (1, 3, 8, 8), "B": (1, 3, 12, 12)},
    ),
    (
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        {"B": (1, 3, 12, 12), "C": (4, 3, 3, 3)},
    ),
    ("E[n, c, h, w] = D[n, c*4+h%2*2+w%2, h//2, w//2]", {"D": (1, 4, 4, 4)}),
    ("F[n, c, h, w] = Select(c<3, A[n, c, h, w], E[n, c-3, h, w])", {"A": (1, 3, 8, 8), "E": (1, 1, 8, 8)}),
]


def test_each_seed_op() -> None:
    pad, dilated, d2s, concat = SMALL_SEED
    check(*pad, lambda A: tf.pad(A[:, :, 1:, 1:], (3, 2, 3, 2)))
    check(*dilated, lambda B, C: tf.conv2d(B, C, stride=2, dilation=2))
    check(*d2s, lambda D: tf.pixel_shuffle(D, 2))
    check(*concat, lambda A, E: torch.cat([A, E], dim=1))


def test_four_op_graph_end_to_end() -> None:
    graph = neoflow.graph(
        "\n".join(text for text, _ in SMALL_SEED),
        shapes={"A": (1, 3, 8, 8), "C": (4, 3, 3, 3), "B": (1, 3, 12, 12)},
        dtype="float64",
    )
    rng = np.random.default_rng(0)
    a, c = rng.standard_normal((1, 3, 8, 8)), rng.standard_normal((4, 3, 3, 3))
    values = neoflow.ir.evaluate_graph(graph, {"A": a, "C": c}, keep=True)
    d_out = rng.standard_normal(values["F"].shape)
    adjoint = {"F": d_out}
    for op in reversed(graph.ops):  # the reverse pass, op by op
        inputs = {t.name: values[t.name] for t in op.inputs}
        for name, value in adjoints(op, inputs, adjoint[op.name]).items():
            adjoint[name] = adjoint.get(name, 0) + value
    ta, tc = torch.tensor(a, requires_grad=True), torch.tensor(c, requires_grad=True)
    b = tf.pad(ta[:, :, 1:, 1:], (3, 2, 3, 2))
    f = torch.cat([ta, tf.pixel_shuffle(tf.conv2d(b, tc, stride=2, dilation=2), 2)], dim=1)
    np.testing.assert_allclose(f.detach().numpy(), values["F"], rtol=1e-12)
    f.backward(torch.tensor(d_out))
    assert relative_error(adjoint["A"], ta.grad.numpy()) < 1e-6
    assert relative_error(adjoint["C"], tc.grad.numpy()) < 1e-6
