"""Training options: a loss the model computes, frozen parameters, the learning rate as an input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import neoflow
from tests.runtime.torch_models import assert_trains_like

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def test_a_scalar_output_the_model_computes_is_the_loss() -> None:
    graph = neoflow.graph(
        """W = tensor([3, 4])
        X = tensor([5, 4])
        Y[n, k] = ReduceAdd({c}, X[n, c] * W[k, c])
        Energy[] = ReduceAdd({n, k}, Y[n, k] * Y[n, k]) * 0.5
        """,
        outputs=["Energy"],
    )
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    model = neoflow.compile(graph, train=neoflow.TrainSpec(loss="Energy", lr=0.01), parameters={"W": w})
    assert model.training.labels is None
    wt = torch.tensor(w, requires_grad=True)
    energy = 0.5 * ((torch.from_numpy(x) @ wt.T) ** 2).sum()
    energy.backward()
    np.testing.assert_allclose(model.gradients({"X": x})["W"], wt.grad.numpy(), rtol=1e-5)
    assert model.train_step({"X": x}) == pytest.approx(energy.item(), rel=1e-6)
    np.testing.assert_allclose(model.parameters()["W"], w - 0.01 * wt.grad.numpy(), rtol=1e-5)


def test_frozen_parameters_stay_and_the_learning_rate_is_an_input() -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1, frozen=("w1", "b1"))
    model = neoflow.compile(MODELS_DIR / "mlp.onnx", train=spec)
    assert model.training.trainable == ("w2", "b2")
    assert "frozen or not reaching the loss: w1, b1" in model.report()
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 64)).astype(np.float32), "y": rng.integers(0, 10, 32)}
    start = model.parameters()
    model.lr = 0.0
    model.train_step(batch)
    for name, value in model.parameters().items():
        np.testing.assert_array_equal(value, start[name])
    model.lr = 0.1
    model.train_step(batch)
    after = model.parameters()
    np.testing.assert_array_equal(after["w1"], start["w1"])
    assert not np.array_equal(after["w2"], start["w2"])
    assert model.step == 2


@pytest.mark.parametrize("keep", [False, True])
def test_a_step_hands_back_the_prediction_only_when_asked(keep: bool) -> None:
    # the prediction is the model output before the step; not kept, it is no output of the step's
    # graph, so a plan stores it only where another kernel reads it (the four-op graph's tile buffer:
    # tests/fusion/test_policies.py)
    spec = neoflow.TrainSpec(labels="y", lr=0.1, keep_prediction=keep)
    model = neoflow.compile(MODELS_DIR / "mlp.onnx", train=spec, target="cpu", fusion="neoflow")
    batch = model.example_batch(training=True)
    before = model.run({name: value for name, value in batch.items() if name != "y"})
    model.train_step(batch)
    prediction = model.training.prediction
    assert (prediction in model._train.planned_graph.outputs) == keep
    if keep:
        np.testing.assert_allclose(model.last_prediction, next(iter(before.values())), rtol=1e-5, atol=1e-6)
        # the step's results are written into two blocks in turn: the prediction handed back
        # must not change when the steps after it write that block again
        first = model.last_prediction
        kept = first.copy()
        for _ in range(3):
            model.train_step(batch)
        np.testing.assert_array_equal(first, kept)
    else:
        assert model.last_prediction is None


def test_a_training_compile_builds_its_inference_executor_when_first_used(monkeypatch) -> None:
    """Compiling a training step plans and builds the step alone; inference is built on first use
    (it used to double a ResNet's compile time) and then answers as an inference compile does."""
    import neoflow.runtime.compiled as compiled

    built = []
    original = compiled.build_executor

    def counting(target, graph, keep, *args, **kwargs):
        built.append(graph)
        return original(target, graph, keep, *args, **kwargs)

    monkeypatch.setattr(compiled, "build_executor", counting)
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    model = neoflow.compile(MODELS_DIR / "mlp.onnx", target="interp", train=spec)
    assert len(built) == 1  # the step's executor
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    got = model.run({"x": x})
    assert len(built) == 2
    model.run({"x": x})
    assert len(built) == 2  # built once
    want = neoflow.compile(MODELS_DIR / "mlp.onnx", target="interp").run({"x": x})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)


def test_a_split_into_several_outputs_trains_like_pytorch() -> None:
    """Each output of a multi-output Split reads its own slice; its adjoint writes that slice alone
    (the adjoint of the first part once read its output's adjoint past its end: issue 39's qkv Split)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 24)).astype(np.float32) / 4
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Split", ["h", "parts"], ["q", "k", "v"], axis=1),
        helper.make_node("Mul", ["q", "k"], ["qk"]),
        helper.make_node("Add", ["qk", "v"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qkv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([8, 8, 8], np.int64), "parts")],
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    batch = {"x": rng.standard_normal((4, 16)).astype(np.float32), "y": rng.integers(0, 8, 4)}
    model = neoflow.compile(onnx_model, target="interp", train=neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1))
    weight = torch.tensor(w, requires_grad=True)
    q, k, v = (torch.from_numpy(batch["x"]) @ weight).split(8, dim=1)
    torch.nn.functional.cross_entropy(q * k + v, torch.from_numpy(batch["y"])).backward()
    np.testing.assert_allclose(model.gradients(batch)["W"], weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def _encoder(width: int = 16, heads: int = 2):
    """Two pre-LN transformer blocks (one qkv Linear and a Split, softmax, GELU) and a head."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

        def forward(self, x):
            b, t, d = x.shape

            def split_heads(z):
                return z.reshape(b, t, heads, d // heads).transpose(1, 2)

            q, k, v = (split_heads(z) for z in self.qkv(self.ln1(x)).split(d, dim=2))
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.head = nn.Sequential(Block(), Block()), nn.Linear(width, 5)

        def forward(self, x):
            return self.head(self.blocks(x).mean(1))

    return Net()


def test_a_transformer_encoder_from_the_torchscript_exporter_trains_like_pytorch(tmp_path) -> None:
    """Issue 39's encoder: its qkv Split trains; the exporter's folded constants (the attention
    scale, a Pow of two constants) are not trained; the LayerNorm weights it deduplicated into one
    initializer and Identity copies are trained each as its own parameter, as in PyTorch."""
    import io

    import onnx

    torch.manual_seed(0)
    net = _encoder()
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))
    buffer = io.BytesIO()
    torch.onnx.export(net, (x,), buffer, dynamo=False, input_names=["x"], output_names=["logits"], opset_version=17)
    exported = onnx.load_from_string(buffer.getvalue())
    assert any(n.op_type == "Identity" for n in exported.graph.node)  # the deduplicated LayerNorm weights
    model = neoflow.compile(exported, target="interp", train=neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1))
    assert "blocks.1.ln2.weight" in model.parameters()
    assert not any("Pow" in model.public_name(p) for p in model.training.trainable)
    assert_trains_like(model, net, torch.optim.SGD(net.parameters(), lr=0.1), [(x, y)] * 3)
    trained = net.state_dict()
    np.testing.assert_allclose(model.parameters()["blocks.1.ln2.weight"], trained["blocks.1.ln2.weight"], atol=1e-6)
    # exported, each trained copy is its own initializer again, and the file infers like the model
    written = onnx.load(model.export_onnx(tmp_path / "trained.onnx"))
    assert "blocks.1.ln2.weight" in {t.name for t in written.graph.initializer}
    with torch.no_grad():
        want = net(x).numpy()
    np.testing.assert_allclose(neoflow.compile(written).run({"x": x.numpy()})["logits"], want, rtol=1e-4, atol=1e-5)


def test_weights_the_exporter_reads_through_a_transpose_are_trained_and_inference_sees_them() -> None:
    """A training-mode export (no constant folding) reads each Linear's weight through a Transpose
    node; folded at import it was a new constant, so the weight was never trained and inference after
    training read the stale copy.  Every parameter of the module is trained, as in PyTorch."""
    import io

    import onnx

    torch.manual_seed(1)
    net = _encoder()
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))
    buffer = io.BytesIO()
    torch.onnx.export(
        net, (x,), buffer, dynamo=False, input_names=["x"], output_names=["logits"], opset_version=17,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
    )  # fmt: skip
    exported = onnx.load_from_string(buffer.getvalue())
    assert any(n.op_type == "Transpose" and n.input[0] == "blocks.0.fc1.weight" for n in exported.graph.node)
    model = neoflow.compile(exported, target="interp", train=neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1))
    assert set(model.parameters()) == {name for name, _ in net.named_parameters()}
    assert_trains_like(model, net, torch.optim.SGD(net.parameters(), lr=0.1), [(x, y)] * 3)
    np.testing.assert_allclose(model.parameters()["blocks.0.fc1.weight"], net.blocks[0].fc1.weight.detach(), atol=1e-6)
    with torch.no_grad():
        want = net(x).numpy()
    np.testing.assert_allclose(model.run({"x": x.numpy()})["logits"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["interp", "cpu"])
def test_a_non_finite_loss_or_gradient_is_reported_with_the_step_when_checked(target: str) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1)
    model = neoflow.compile(MODELS_DIR / "mlp.onnx", target=target, train=spec)
    rng = np.random.default_rng(0)
    batch = model.example_batch(training=True)
    good = {name: value.copy() for name, value in batch.items()}
    model.train_step(good, check=True)
    before = model.parameters()
    poisoned = {name: value.copy() for name, value in batch.items()}
    x = next(name for name, value in poisoned.items() if value.dtype.kind == "f")
    poisoned[x][0, rng.integers(poisoned[x].shape[1])] = np.inf
    with pytest.raises(neoflow.NumericError) as info:
        model.train_step(poisoned, check=True)
    message = str(info.value)
    assert message.startswith("numeric error: training step 2:") and "\n" not in message
    after = model.parameters()
    assert all(np.array_equal(before[name], after[name]) for name in before), "a failed step changes nothing"
    model.train_step(poisoned)  # unchecked, as before: the step runs
