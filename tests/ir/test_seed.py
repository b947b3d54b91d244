"""The seed's six statements and its four-op graph against independent numpy/PyTorch code."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

import neoflow
from tests.on_targets import evaluate_on

MODELS = Path(__file__).resolve().parents[2] / "models"
PAD = "B[n, c, h, w] = Select(h>2 && h<226 && w>2 && w<226, A[n, c, h-2, w-2], 0)"
DILATED = "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])"
D2S = "E[n, c, h, w] = D[n, c*4+h%2*2+w%2, h//2, w//2]"
CONCAT = "F[n, c, h, w] = Select(c<3, A[n, c, h, w], E[n, c-3, h, w])"
CAPSULE = "C[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, A[b, c, p*2+r, q*2+s, i, t] * B[k, c, r, s, t, j])"
QUASI = "Out[b, k, p, q] = ReduceAdd({c, r, s}, In[b, c, p*2+r, q/2+s] * Weight[k, c, r, s])"


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def reference_pad(a: np.ndarray) -> np.ndarray:
    b = np.zeros((*a.shape[:2], 228, 228), np.float32)
    b[:, :, 3:226, 3:226] = a[:, :, 1:224, 1:224]  # h in (2, 226) reads A[h - 2]
    return b


def reference_dilated(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return tf.conv2d(torch.from_numpy(b), torch.from_numpy(c), stride=2, dilation=2).numpy()


def reference_d2s(d: np.ndarray) -> np.ndarray:
    return tf.pixel_shuffle(torch.from_numpy(d), 2).numpy()


def test_padding(target: str) -> None:
    a = rand(1, 3, 224, 224)
    op = neoflow.op(PAD, shapes={"A": a.shape, "B": (1, 3, 228, 228)})
    np.testing.assert_array_equal(evaluate_on(target, op, {"A": a}), reference_pad(a))


def test_dilated_conv_infers_its_output_shape(target: str) -> None:
    b, c = rand(1, 3, 228, 228), rand(64, 3, 3, 3)
    op = neoflow.op(DILATED, shapes={"B": b.shape, "C": c.shape})
    assert op.shape == (1, 64, 112, 112)
    assert set(op.reduce_axes) == {"r", "s", "c"}
    np.testing.assert_allclose(evaluate_on(target, op, {"B": b, "C": c}), reference_dilated(b, c), rtol=1e-4, atol=1e-4)


def test_depth_to_space(target: str) -> None:
    d = rand(1, 64, 112, 112)
    op = neoflow.op(D2S, shapes={"D": d.shape})
    assert op.shape == (1, 16, 224, 224)
    np.testing.assert_array_equal(evaluate_on(target, op, {"D": d}), reference_d2s(d))


def test_concatenation(target: str) -> None:
    a, e = rand(1, 3, 224, 224), rand(1, 16, 224, 224)
    op = neoflow.op(CONCAT, shapes={"A": a.shape, "E": e.shape})
    assert op.shape == (1, 19, 224, 224)
    np.testing.assert_array_equal(evaluate_on(target, op, {"A": a, "E": e}), np.concatenate([a, e], axis=1))


@pytest.mark.parametrize("a_shape", [(2, 3, 9, 9, 4, 4), (1, 2, 7, 8, 2, 3)])
def test_capsule_conv(a_shape: tuple[int, ...], target: str) -> None:
    a = rand(*a_shape)
    b = rand(5, a_shape[1], 3, 3, a_shape[5], 4)
    op = neoflow.op(CAPSULE, shapes={"A": a.shape, "B": b.shape})
    windows = torch.from_numpy(a).unfold(2, 3, 2).unfold(3, 3, 2)  # b c p q i t r s
    expected = torch.einsum("bcpqitrs,kcrstj->bkpqij", windows, torch.from_numpy(b)).numpy()
    assert op.shape == expected.shape
    np.testing.assert_allclose(evaluate_on(target, op, {"A": a, "B": b}), expected, rtol=1e-4, atol=1e-4)


def test_quasi_affine_running_example(target: str) -> None:
    x, w = rand(2, 3, 9, 7), rand(4, 3, 3, 3)
    op = neoflow.op(QUASI, shapes={"In": x.shape, "Weight": w.shape})
    # p: stride 2; q: each column q reads input column q//2 + s, i.e. a stride-1 conv upsampled by 2
    conv = tf.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=(2, 1))
    expected = conv.repeat_interleave(2, dim=3).numpy()
    assert op.shape == expected.shape == (2, 4, 4, 10)
    np.testing.assert_allclose(evaluate_on(target, op, {"In": x, "Weight": w}), expected, rtol=1e-4, atol=1e-4)


def test_quasi_affine_against_loops(target: str) -> None:
    x, w = rand(1, 2, 6, 5, seed=3), rand(2, 2, 2, 2, seed=4)
    op = neoflow.op(QUASI, shapes={"In": x.shape, "Weight": w.shape})
    got = evaluate_on(target, op, {"In": x, "Weight": w})
    expected = np.zeros(op.shape, np.float64)
    for b, k, p, q in np.ndindex(*op.shape):
        for c, r, s in np.ndindex(2, 2, 2):
            expected[b, k, p, q] += x[b, c, p * 2 + r, q // 2 + s] * w[k, c, r, s]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_four_op_graph_at_full_size(target: str) -> None:
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    assert [op.name for op in graph.ops] == ["B", "D", "E", "F"]
    assert [t.name for t in graph.inputs] == ["A", "C"] and graph.outputs == ("F",)
    a, c = rand(1, 3, 224, 224), rand(64, 3, 3, 3)
    out = evaluate_on(target, graph, {"A": a, "C": c})["F"]
    e = reference_d2s(reference_dilated(reference_pad(a), c))
    np.testing.assert_allclose(out, np.concatenate([a, e], axis=1), rtol=1e-4, atol=1e-4)


def test_four_op_graph_shapes_inferred_from_inputs(target: str) -> None:
    text = "\n".join([PAD, DILATED, D2S, CONCAT])
    graph = neoflow.graph(text, shapes={"A": (1, 3, 224, 224), "C": (64, 3, 3, 3), "B": (1, 3, 228, 228)})
    assert {name: t.shape for name, t in graph.tensors.items()} == {
        "A": (1, 3, 224, 224),
        "C": (64, 3, 3, 3),
        "B": (1, 3, 228, 228),
        "D": (1, 64, 112, 112),
        "E": (1, 16, 224, 224),
        "F": (1, 19, 224, 224),
    }
