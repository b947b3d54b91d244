"""The capsule-conv network and the seed's four-op graph train, with gradients matching PyTorch."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import neoflow
from tests.runtime.torch_models import capsule, four_op

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def _relative(ours: np.ndarray, theirs: torch.Tensor) -> float:
    reference = theirs.detach().numpy()
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def test_capsule_network_gradients_match_pytorch_and_loss_falls(target: str) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)
    model = neoflow.compile(MODELS_DIR / "capsule.onnx", target=target, train=spec)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    F.cross_entropy(capsule(params)(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    grads = model.gradients({"x": x, "y": y})
    assert set(grads) == {"k1", "k2", "w", "b"}
    for name, value in grads.items():
        assert _relative(value, params[name].grad) < 1e-5, name
    losses = [model.train_step({"x": x, "y": y}) for _ in range(50)]
    assert losses[-1] < 0.1 * losses[0]
    assert all(b <= a * 1.5 for a, b in itertools.pairwise(losses))  # no blow-up on the way


def test_four_op_graph_trains_against_a_random_target(target: str) -> None:
    graph = neoflow.graph((MODELS_DIR / "four_op.nf").read_text())
    rng = np.random.default_rng(0)
    a0 = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    c0 = (rng.standard_normal((64, 3, 3, 3)) / 5).astype(np.float32)
    goal = rng.standard_normal((1, 19, 224, 224)).astype(np.float32)
    spec = neoflow.TrainSpec(loss="mse", labels="target", optimizer="sgd", lr=0.5)
    model = neoflow.compile(graph, target=target, train=spec, parameters={"A": a0, "C": c0})
    a, c = torch.tensor(a0, requires_grad=True), torch.tensor(c0, requires_grad=True)
    F.mse_loss(four_op(a, c), torch.from_numpy(goal)).backward()
    grads = model.gradients({"target": goal})
    assert _relative(grads["A"], a.grad) < 1e-5
    assert _relative(grads["C"], c.grad) < 1e-5
    losses = [model.train_step({"target": goal}) for _ in range(3)]
    assert losses[2] < losses[1] < losses[0]
    assert not np.array_equal(model.parameters()["A"], a0)
