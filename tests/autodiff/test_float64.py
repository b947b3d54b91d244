"""float64 ops and their derived adjoints hold to 1e-13 of PyTorch's float64 autograd, in the interpreter
and in compiled C: literals are weakly typed (``X * 0.1`` multiplies by the float64 nearest 0.1, the
adjoint of ``X / 3`` by the float64 nearest 1/3), never rounded to float32 on the way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as tf

import neoflow
from tests.on_targets import TARGETS

from .gradcheck import relative_error

TOLERANCE = 1e-13
MEAN = "ReduceAdd({k}, X[i, k]) / 7"
VAR = "ReduceAdd({l}, (X[i, l] - ReduceAdd({m}, X[i, m]) / 7) * (X[i, l] - ReduceAdd({m}, X[i, m]) / 7)) / 7"
SOFTMAX = "exp(X[i, j] - ReduceMax({m}, X[i, m])) / ReduceAdd({k}, exp(X[i, k] - ReduceMax({l}, X[i, l])))"
GELU = "0.5 * X[i, j] * (1 + tanh(0.7978845608028654 * (X[i, j] + 0.044715 * X[i, j] * X[i, j] * X[i, j])))"

CASES = {
    "scale_by_a_tenth": ("Y[i, j] = X[i, j] * 0.1", {"X": (3, 7)}, lambda X: X * 0.1),
    "divide_by_three": ("Y[i, j] = X[i, j] / 3", {"X": (3, 7)}, lambda X: X / 3),
    "divide_by_seven_and_add_a_third": ("Y[i, j] = X[i, j] / 7.0 + 1 / 3", {"X": (3, 7)}, lambda X: X / 7.0 + 1 / 3),
    "constant_expression": (
        "Y[i, j] = X[i, j] * exp(-0.5) / sqrt(2 * 3.141592653589793)",
        {"X": (3, 7)},
        lambda X: X * math.exp(-0.5) / math.sqrt(2 * math.pi),
    ),
    "mean": (f"Y[i] = {MEAN}", {"X": (3, 7)}, lambda X: X.mean(dim=1)),
    "layer_norm": (
        f"Y[i, j] = (X[i, j] - {MEAN}) / sqrt({VAR} + 1e-5) * G[j] + B[j]",
        {"X": (3, 7), "G": (7,), "B": (7,)},
        lambda X, G, B: tf.layer_norm(X, (7,), G, B, eps=1e-5),
    ),
    "softmax": (f"Y[i, j] = {SOFTMAX}", {"X": (3, 7)}, lambda X: torch.softmax(X, dim=1)),
    "gelu_tanh": (f"Y[i, j] = {GELU}", {"X": (3, 7)}, lambda X: tf.gelu(X, approximate="tanh")),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_ops_and_adjoints_match_pytorch_to_1e_13(case: str, target: str) -> None:
    text, shapes, torch_fn = CASES[case]
    op = neoflow.op(text, shapes=shapes, dtype="float64")
    rng = np.random.default_rng(7)
    inputs = {t.name: rng.standard_normal(t.shape) for t in op.inputs}
    dout = rng.standard_normal(op.shape)
    tensors = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in inputs.items()}
    expected = torch_fn(**tensors)
    expected.backward(torch.tensor(dout))
    layer = neoflow.compile(op, target=target, grad=True)
    found = layer.run(inputs)
    assert found.dtype == np.float64
    assert relative_error(found, expected.detach().numpy()) < TOLERANCE
    grads = layer.backward(inputs, {f"d{op.name}": dout})
    for name, tensor in tensors.items():
        error = relative_error(grads[name], tensor.grad.numpy())
        assert error < TOLERANCE, f"d{name}: {error:.1e} from PyTorch's float64 autograd"


@pytest.mark.parametrize("target", TARGETS)
def test_float32_ops_round_a_literal_once_to_float32(target: str) -> None:
    op = neoflow.op("Y[i] = X[i] * 0.1 + 1 / 3", shapes={"X": (5,)})
    x = np.arange(5, dtype=np.float32)
    found = neoflow.compile(op, target=target).run({"X": x})
    assert found.dtype == np.float32
    np.testing.assert_array_equal(found, x * np.float32(0.1) + np.float32(1 / 3))
