"""save / load / export_onnx: trained parameters leave neoflow and run anywhere."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

import neoflow
from neoflow.errors import CompileError

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def _batches(count: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.standard_normal((32, 1, 8, 8)).astype(np.float32), "y": rng.integers(0, 10, 32)} for _ in range(count)
    ]


def test_save_load_resumes_training_exactly(tmp_path: Path) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)
    batches = _batches(6)
    straight = neoflow.compile(MODELS_DIR / "cnn.onnx", train=spec)
    expected = [straight.train_step(b) for b in batches]
    first = neoflow.compile(MODELS_DIR / "cnn.onnx", train=spec)
    losses = [first.train_step(b) for b in batches[:3]]
    first.save(tmp_path / "build")
    assert {p.name for p in (tmp_path / "build").iterdir()} == {
        "manifest.json",
        "model.onnx",
        "report.txt",
        "state.npz",
        "train_step.nf",
    }
    resumed = neoflow.load(tmp_path / "build")
    assert resumed.step == 3
    losses += [resumed.train_step(b) for b in batches[3:]]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    for name, value in straight.parameters().items():
        np.testing.assert_allclose(resumed.parameters()[name], value, rtol=1e-6, atol=1e-7)


def test_export_onnx_runs_in_onnxruntime_with_the_same_predictions(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    source = MODELS_DIR / "cnn.onnx"
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    model = neoflow.compile(source, train=neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2))
    for batch in _batches(5):
        model.train_step(batch)
    path = model.export_onnx(tmp_path / "trained.onnx")
    onnx.checker.check_model(onnx.load(path))
    x = _batches(1, seed=11)[0]["x"]
    ours = model.run({"x": x})["logits"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert (ours.argmax(1) == theirs.argmax(1)).all()
    untrained = neoflow.compile(source).run({"x": x})["logits"]
    assert not np.allclose(untrained, ours)  # the export holds the trained weights, not the originals
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before  # the input file is untouched


def test_text_model_saves_and_loads(tmp_path: Path) -> None:
    graph = neoflow.graph("W = tensor([3, 4])\nX = tensor([5, 4])\nY[n, k] = ReduceAdd({c}, X[n, c] * W[k, c])")
    spec = neoflow.TrainSpec(loss="mse", labels="target", optimizer="momentum", lr=0.1)
    rng = np.random.default_rng(0)
    model = neoflow.compile(graph, train=spec, parameters={"W": rng.standard_normal((3, 4))})
    batch = {"X": rng.standard_normal((5, 4)), "target": rng.standard_normal((5, 3))}
    model.train_step(batch)
    model.save(tmp_path / "b")
    loaded = neoflow.load(tmp_path / "b")
    np.testing.assert_array_equal(loaded.parameters()["W"], model.parameters()["W"])
    assert loaded.train_step(batch) == pytest.approx(model.train_step(batch), rel=1e-6)
    with pytest.raises(CompileError, match="export_onnx needs a model imported from ONNX"):
        model.export_onnx(tmp_path / "x.onnx")
