"""The tensorcore target end to end (custom ops, training steps of the shipped models, the CLI),
and the cuda target's compile path on a machine without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.targets.cuda.model import round_to
from neoflow.targets.cuda.plan import MmaKernel
from tests.targets.cuda.gpu_cases import capsule, inputs_for, needs_nvrtc

MODELS_DIR = Path(__file__).resolve().parents[3] / "models"


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("stride", [1, 2])
def test_custom_op_runs_forward_and_backward_on_the_model(stride: int) -> None:
    op = capsule(stride)
    inputs = inputs_for(op)
    layer = neoflow.compile(op, target="tensorcore", grad=True)
    reference = neoflow.compile(op, target="interp", grad=True)
    out = layer.run(inputs)
    assert _relative(out, reference.run(inputs)) < 2e-3  # tf32 operands, fp32 sums
    dout = {"dOut": np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)}
    grads, want = layer.backward(inputs, dout), reference.backward(inputs, dout)
    for name in ("In", "W"):
        assert _relative(grads[name], want[name]) < 2e-3, name
    exact = neoflow.compile(op, target="tensorcore", grad=True, precision="fp32")
    assert _relative(exact.run(inputs), reference.run(inputs)) < 1e-6


@pytest.mark.parametrize(
    "model, labels, shape",
    [("mlp.onnx", "y", (32, 64)), ("cnn.onnx", "y", (32, 1, 8, 8)), ("capsule.onnx", "y", (32, 1, 8, 8))],
)
def test_training_step_gradients_match_the_interpreter(model: str, labels: str, shape) -> None:
    spec = neoflow.TrainSpec(labels=labels, optimizer="sgd", lr=0.05)
    rng = np.random.default_rng(0)
    # the input and the parameters hold values tf32 holds exactly: the first layer's pre-activations
    # then differ from the interpreter's only in the order of the sums, so no ReLU mask flips
    batch = {"x": round_to(rng.standard_normal(shape), "bfloat16"), labels: rng.integers(0, 10, shape[0])}
    ours = neoflow.compile(MODELS_DIR / model, target="tensorcore", train=spec, fusion="neoflow", precision="tf32")
    reference = neoflow.compile(MODELS_DIR / model, target="interp", train=spec, fusion="neoflow")
    exact = {name: round_to(value, "bfloat16") for name, value in reference.parameters().items()}
    ours.set_parameters(exact)
    reference.set_parameters(exact)
    assert any(isinstance(kernel, MmaKernel) for plan in ours._train.plans.values() for kernel in plan.kernels), (
        "no contraction of the step ran on the tensor cores"
    )
    got, want = ours.gradients(batch), reference.gradients(batch)
    for name in want:
        assert _relative(got[name], want[name]) < 3e-3, name  # tf32 operands past the first layer
    assert ours.train_step(batch) == pytest.approx(reference.train_step(batch), rel=1e-3)


def test_four_op_graph_training_step_on_the_model() -> None:
    text = (MODELS_DIR / "four_op.nf").read_text()
    for big, small in (("224", "24"), ("228", "28"), ("226", "26"), ("112", "12")):  # the same graph, smaller
        text = text.replace(big, small)
    graph = neoflow.graph(text)
    rng = np.random.default_rng(0)
    a0 = rng.standard_normal((1, 3, 24, 24)).astype(np.float32)
    c0 = (rng.standard_normal((64, 3, 3, 3)) / 5).astype(np.float32)
    goal = {"target": rng.standard_normal((1, 19, 24, 24)).astype(np.float32)}
    spec = neoflow.TrainSpec(loss="mse", labels="target", optimizer="sgd", lr=0.5)
    ours = neoflow.compile(graph, target="tensorcore", train=spec, parameters={"A": a0, "C": c0})
    reference = neoflow.compile(graph, target="interp", train=spec, parameters={"A": a0, "C": c0})
    got, want = ours.gradients(goal), reference.gradients(goal)
    for name in ("A", "C"):
        assert _relative(got[name], want[name]) < 3e-3, name


def test_a_precision_needs_tensor_cores() -> None:
    op = capsule(1)
    with pytest.raises(CompileError, match="precision 'fp16' needs tensor cores"):
        neoflow.compile(op, target="cpu", precision="fp16")
    with pytest.raises(CompileError, match="unknown precision 'fp8'"):
        neoflow.compile(op, target="tensorcore", precision="fp8")


@needs_nvrtc
def test_cuda_build_directory_compiles_without_a_gpu(tmp_path: Path) -> None:
    model = neoflow.compile(MODELS_DIR / "mlp.onnx", target="cuda", train=neoflow.TrainSpec(labels="y"))
    out = model.save(tmp_path / "build")
    names = {p.name for p in out.iterdir()}
    assert {"inference.cu", "train_step.cu", "inference.sm_90.cubin", "train_step.sm_90.cubin"} <= names
    assert "mma.sync" in (out / "train_step.cu").read_text()


def test_cli_runs_the_model_target_and_prints_predicted_kernel_times(tmp_path: Path, capsys) -> None:
    from neoflow.cli import main

    assert main(["compile", str(MODELS_DIR / "capsule.onnx"), "--target", "tensorcore", "-o", str(tmp_path)]) == 0
    assert main(["run", str(tmp_path), "--random"]) == 0
    printed = capsys.readouterr().out
    assert "predicted on H100" in printed and "mma tf32" in printed


def test_fuse_compares_policies_by_the_models_predicted_gpu_time(capsys) -> None:
    from neoflow.cli import main

    model = str(MODELS_DIR / "capsule.onnx")
    assert main(["fuse", model, "--train", "--labels", "y", "--target", "tensorcore", "--compare", "none,neoflow"]) == 0
    out = capsys.readouterr().out
    assert "(target tensorcore)" in out and "policies compared" in out
    ours = neoflow.compile(MODELS_DIR / "capsule.onnx", target="tensorcore", train=neoflow.TrainSpec(labels="y"))
    predicted = ours._train.predicted
    # the "measured" column of a model target is its predicted GPU time, not numpy's wall clock
    from neoflow.runtime.fusion_report import fusion_report

    report = fusion_report(ours, training=True)
    assert report.step_seconds == pytest.approx(sum(predicted.values()), rel=1e-9)
