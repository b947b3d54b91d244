"""Same initial weights, same data order: neoflow's training steps equal PyTorch's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import neoflow
from tests.runtime.torch_models import MODELS

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
SHAPES = {"mlp": (32, 64), "cnn": (32, 1, 8, 8)}
OPTIMIZERS = {
    "sgd": (dict(optimizer="sgd", lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "adam": (dict(optimizer="adam", lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "nesterov": (
        dict(optimizer="nesterov", lr=0.05, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ),
    "momentum": (
        dict(optimizer="sgd", momentum=0.8, lr=0.05),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8),
    ),
    "adamw": (
        dict(optimizer="adamw", lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99)),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99)),
    ),
    "adam_l2": (
        dict(optimizer="adam", lr=1e-2, weight_decay=0.05),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05),
    ),
}


def _losses(kind: str, optimizer: str, steps: int, target: str = "interp") -> tuple[list[float], list[float]]:
    settings, make_torch = OPTIMIZERS[optimizer]
    spec = neoflow.TrainSpec(labels="y", **settings)
    model = neoflow.compile(MODELS_DIR / f"{kind}.onnx", target=target, train=spec)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    forward = MODELS[kind](params)
    optim = make_torch(list(params.values()))
    rng = np.random.default_rng(7)
    ours, theirs = [], []
    for _ in range(steps):
        x = rng.standard_normal(SHAPES[kind]).astype(np.float32)
        y = rng.integers(0, 10, 32)
        ours.append(model.train_step({"x": x, "y": y}))
        optim.zero_grad()
        loss = F.cross_entropy(forward(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optim.step()
        theirs.append(loss.item())
    return ours, theirs


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_first_20_steps_match_pytorch(kind: str, optimizer: str, target: str) -> None:
    ours, theirs = _losses(kind, optimizer, 20, target)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert ours[-1] < ours[0]  # it learns (the data is random, but 20 steps fit it a little)


@pytest.mark.parametrize("optimizer", ["nesterov", "momentum", "adamw", "adam_l2"])
def test_other_optimizers_match_pytorch(optimizer: str) -> None:
    ours, theirs = _losses("mlp", optimizer, 10)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
