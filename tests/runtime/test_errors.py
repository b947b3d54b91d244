"""Bad training input gets a one-line neoflow error naming the cause."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError, InputError, NeoflowError, ShapeError

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MLP = MODELS_DIR / "mlp.onnx"


@pytest.fixture(scope="module")
def mlp() -> neoflow.CompiledModel:
    return neoflow.compile(MLP, train=neoflow.TrainSpec(labels="y"))


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_wrong_label_shape(mlp) -> None:
    x = np.zeros((32, 64), np.float32)
    with pytest.raises(InputError) as err:
        mlp.train_step({"x": x, "y": np.zeros((32, 1), np.int64)})
    assert "labels 'y' have shape [32, 1], expected [32]" in _one_line(err)


def test_labels_out_of_range_and_not_integers(mlp) -> None:
    x = np.zeros((32, 64), np.float32)
    with pytest.raises(InputError, match=r"label 10 in 'y' is outside \[0, 10\)"):
        mlp.train_step({"x": x, "y": np.full(32, 10)})
    with pytest.raises(InputError, match="must be integer class indices"):
        mlp.train_step({"x": x, "y": np.zeros(32, np.float32)})


def test_missing_input(mlp) -> None:
    with pytest.raises(InputError) as err:
        mlp.train_step({"y": np.zeros(32, np.int64)})
    assert _one_line(err) == "input error: missing input 'x' (expected shape [32, 64], float32)"
    with pytest.raises(InputError, match="missing labels 'y'"):
        mlp.train_step({"x": np.zeros((32, 64), np.float32)})
    with pytest.raises(InputError, match="'z' is not an input of the model"):
        mlp.run({"x": np.zeros((32, 64), np.float32), "z": 1})


def test_loss_over_a_non_scalar() -> None:
    with pytest.raises(ShapeError) as err:
        neoflow.compile(MLP, train=neoflow.TrainSpec(loss="logits"))
    assert "the loss 'logits' has shape [32, 10]; a loss must be a scalar" in _one_line(err)


def test_parameter_that_does_not_exist() -> None:
    with pytest.raises(InputError) as err:
        neoflow.compile(MLP, train=neoflow.TrainSpec(labels="y", frozen=("w3",)))
    assert _one_line(err) == "input error: frozen parameter 'w3' does not exist (the model has: b1, b2, w1, w2)"
    with pytest.raises(InputError, match="parameter 'nope' is not an input of the model"):
        neoflow.compile(MLP, parameters={"nope": np.zeros(3)})
    model = neoflow.compile(MLP)
    with pytest.raises(InputError, match="parameter 'w9' does not exist"):
        model.set_parameters({"w9": np.zeros(3)})


@pytest.mark.parametrize(
    ("spec", "kind", "message"),
    [
        (neoflow.TrainSpec(optimizer="rmsprop"), InputError, "unknown optimizer 'rmsprop'"),
        (neoflow.TrainSpec(loss="hinge"), InputError, "loss output 'hinge' does not exist"),
        (neoflow.TrainSpec(labels="x"), InputError, "the label name 'x' is already a tensor of the model"),
        (neoflow.TrainSpec(output="h2"), InputError, "output 'h2' does not exist"),
        (neoflow.TrainSpec(lr=0.1, momentum=1.5), InputError, "optimizer settings out of range"),
    ],
)
def test_bad_specs(spec, kind, message) -> None:
    with pytest.raises(kind, match=message):
        neoflow.compile(MLP, train=spec)


def test_unknown_target_and_inference_only_model() -> None:
    with pytest.raises(CompileError, match="unknown target 'tpu'"):
        neoflow.compile(MLP, target="tpu")
    model = neoflow.compile(MLP)
    with pytest.raises(CompileError, match="compiled for inference"):
        model.train_step({})


def test_cross_entropy_needs_two_dimensional_logits() -> None:
    graph = neoflow.graph("X = tensor([4, 3, 2])\nY[i, j, k] = X[i, j, k] * 2")
    with pytest.raises(ShapeError, match=r"logits of shape \[batch, classes\]"):
        neoflow.compile(graph, train=neoflow.TrainSpec(), parameters={"X": np.ones((4, 3, 2))})


def test_errors_are_neoflow_errors() -> None:
    with pytest.raises(NeoflowError):
        neoflow.compile(MODELS_DIR / "missing.onnx")
    with pytest.raises(InputError, match="not a neoflow build directory"):
        neoflow.load(MODELS_DIR)


def test_a_stream_is_for_gpu_arrays_on_the_cuda_target() -> None:
    layer = neoflow.compile(neoflow.op("Y[i] = X[i] * 2", shapes={"X": (4,)}), target="cpu")
    with pytest.raises(neoflow.CompileError, match="stream= are for GPU arrays on the cuda target"):
        layer.run({"X": np.ones(4, np.float32)}, stream=0)
