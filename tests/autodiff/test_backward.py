"""The graph reverse pass: adjoints chained through a graph and summed over consumers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import neoflow
from neoflow.autodiff.backward import backward
from neoflow.errors import CompileError
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate_graph

TEXT = """
X = tensor([4, 5])
W = tensor([5, 3])
H[i, k] = ReduceAdd({c}, X[i, c] * W[c, k])
A[i, k] = tanh(H[i, k]) * H[i, k]
B[i, k] = A[i, k] + H[i, 2 - k] * X[i, k + 2]
L[] = ReduceAdd({i, k}, B[i, k] * A[i, k]) + ReduceMax({i, k}, H[i, k])
"""


def _torch_grads(x: np.ndarray, w: np.ndarray) -> dict[str, np.ndarray]:
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    h = xt @ wt
    a = torch.tanh(h) * h
    b = a + h.flip(1) * xt[:, 2:]
    loss = (b * a).sum() + h.max()
    loss.backward()
    return {"X": xt.grad.numpy(), "W": wt.grad.numpy()}


def test_gradients_sum_over_every_consumer_and_match_pytorch() -> None:
    graph = neoflow.graph(TEXT, dtype="float64")
    reverse = backward(graph, "L", ["X", "W"])
    assert set(reverse.gradients) == {"X", "W"}
    # H feeds A, B and L; A feeds B and L; X feeds H and B: their gradients are sums
    full = Graph.from_ops([*graph.ops, *reverse.ops], outputs=list(reverse.gradients.values()))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    ours = evaluate_graph(full, {"X": x, "W": w})
    expected = _torch_grads(x, w)
    for name, grad in reverse.gradients.items():
        np.testing.assert_allclose(ours[grad], expected[name], rtol=1e-10, atol=1e-12)
    assert set(reverse.saved) >= {"X", "H"}


def test_stop_and_unreached() -> None:
    graph = neoflow.graph(TEXT + "\nZ[i] = X[i, 0] * 2\n", dtype="float64", outputs=["L", "Z"])
    reverse = backward(graph, "Z", ["X", "W"])
    assert reverse.unreached == ("W",)
    stopped = backward(graph, "L", ["X", "W"], stop={"H"})
    # with H a constant, only the direct read of X in B carries a gradient; W gets none
    assert stopped.unreached == ("W",)
    full = Graph.from_ops([*graph.ops, *stopped.ops], outputs=[stopped.gradients["X"]])
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    values = evaluate_graph(graph, {"X": x, "W": w}, keep=True)
    expected = np.zeros((4, 5))
    expected[:, 2:] = values["H"][:, ::-1] * values["A"]
    np.testing.assert_allclose(evaluate_graph(full, {"X": x, "W": w})[stopped.gradients["X"]], expected)


def test_unknown_loss() -> None:
    graph = neoflow.graph(TEXT)
    with pytest.raises(CompileError, match="the loss 'Q' is not a tensor of the graph"):
        backward(graph, "Q", ["X"])
