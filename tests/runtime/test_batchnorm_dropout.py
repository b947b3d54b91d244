"""BatchNormalization trains with batch statistics and updates its running
statistics; Dropout drops by a seeded mask."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import neoflow
from neoflow.errors import UnsupportedOpError


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(dropout: float) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "c"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["n"], momentum=0.8),
        helper.make_node("Relu", ["n"], ["a"]),
        helper.make_node("Flatten", ["a"], ["f"]),
        helper.make_node("Dropout", ["f", "ratio"], ["d"]),
        helper.make_node("Gemm", ["d", "w", "b"], ["logits"], transB=1),
    ]
    inits = [
        _init("c", rng.standard_normal((4, 2, 3, 3)) / 4),
        _init("scale", rng.uniform(0.5, 1.5, 4)),
        _init("bias", rng.standard_normal(4) / 10),
        _init("mean", rng.standard_normal(4) / 10),
        _init("var", rng.uniform(0.5, 1.5, 4)),
        _init("ratio", np.array(dropout)),
        _init("w", rng.standard_normal((3, 4 * 5 * 5)) / 10),
        _init("b", np.zeros(3)),
    ]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 2, 5, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [6, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _batch(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((6, 2, 5, 5)).astype(np.float32), "y": rng.integers(0, 3, 6)}


def test_batchnorm_training_matches_pytorch_and_updates_running_statistics(target: str) -> None:
    model = neoflow.compile(_model(0.0), target=target, train=neoflow.TrainSpec(labels="y", lr=0.1))
    assert set(model.training.trainable) == {"c", "scale", "bias", "w", "b"}
    start = model.parameters()
    p = {k: torch.tensor(v, requires_grad=True) for k, v in start.items() if k not in ("mean", "var", "ratio")}
    batch = _batch()
    x = torch.from_numpy(batch["x"])
    h = F.conv2d(x, p["c"], padding=1)
    running_mean, running_var = torch.tensor(start["mean"]), torch.tensor(start["var"])
    n = F.batch_norm(h, running_mean.clone(), running_var.clone(), p["scale"], p["bias"], training=True, eps=1e-5)
    logits = F.relu(n).flatten(1) @ p["w"].T + p["b"]
    loss = F.cross_entropy(logits, torch.from_numpy(batch["y"]))
    loss.backward()
    grads = model.gradients(batch)
    for name, g in grads.items():
        np.testing.assert_allclose(g, p[name].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert model.train_step(batch) == pytest.approx(loss.item(), rel=1e-5)
    # ONNX: running = running * momentum + batch statistic * (1 - momentum), biased variance
    hn = h.detach().numpy()
    after = model.parameters()
    np.testing.assert_allclose(after["mean"], start["mean"] * 0.8 + hn.mean((0, 2, 3)) * 0.2, rtol=1e-5)
    np.testing.assert_allclose(after["var"], start["var"] * 0.8 + hn.var((0, 2, 3)) * 0.2, rtol=1e-5)
    # inference uses the running statistics
    with torch.no_grad():
        params = {k: torch.tensor(v) for k, v in after.items()}
        n = F.batch_norm(
            F.conv2d(x, params["c"], padding=1),
            params["mean"],
            params["var"],
            params["scale"],
            params["bias"],
            eps=1e-5,
        )
        expected = F.relu(n).flatten(1) @ params["w"].T + params["b"]
    np.testing.assert_allclose(model.run({"x": batch["x"]})["logits"], expected.numpy(), rtol=1e-4, atol=1e-5)
    assert "running statistics updated: mean, var" in model.report()


def test_dropout_mask_is_seeded_and_drops_the_ratio() -> None:
    spec = neoflow.TrainSpec(labels="y", lr=0.0, seed=5)
    first = neoflow.compile(_model(0.5), train=spec)
    second = neoflow.compile(_model(0.5), train=spec)
    batch = _batch()
    a = [first.gradients(batch)["w"] for _ in range(2)]
    b = second.gradients(batch)["w"]
    np.testing.assert_array_equal(a[0], b)  # same seed, same step: the same mask
    loss_1, loss_2 = first.train_step(batch), first.train_step(batch)  # lr 0: only the mask changes
    assert loss_1 != loss_2
    other = neoflow.compile(_model(0.5), train=neoflow.TrainSpec(labels="y", lr=0.0, seed=6))
    assert not np.array_equal(other.gradients(batch)["w"], b)
    # the mask is uniform noise from numpy's generator seeded by (seed, step) compared with the ratio
    mask = np.random.default_rng((5, 0)).random((6, 100), np.float32) >= 0.5
    assert 0.4 < mask.mean() < 0.6
    p = {k: torch.tensor(v, requires_grad=True) for k, v in neoflow.compile(_model(0.5)).parameters().items()}
    x = torch.from_numpy(batch["x"])
    n = F.batch_norm(F.conv2d(x, p["c"], padding=1), None, None, p["scale"], p["bias"], training=True, eps=1e-5)
    dropped = F.relu(n).flatten(1) * torch.from_numpy(mask) / 0.5
    loss = F.cross_entropy(dropped @ p["w"].T + p["b"], torch.from_numpy(batch["y"]))
    loss.backward()
    assert loss_1 == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(b, p["w"].grad.numpy(), rtol=1e-4, atol=1e-6)
    # inference is the identity
    plain = neoflow.compile(_model(0.0))
    plain.set_parameters(first.parameters())
    np.testing.assert_allclose(first.run({"x": batch["x"]})["logits"], plain.run({"x": batch["x"]})["logits"])


def test_a_training_mode_batchnorm_infers_with_its_running_statistics() -> None:
    """A node exported in training mode is the same layer: inference normalises with the running
    statistics (the model's eval mode), exactly as the node without the attribute."""
    plain = _model(0.0)
    exported = _model(0.0)
    node = exported.graph.node[1]
    node.attribute.append(helper.make_attribute("training_mode", 1))
    node.output.extend(["running_mean_out", "running_var_out"])
    x = _batch()["x"]
    got = neoflow.compile(exported).run({"x": x})["logits"]
    np.testing.assert_array_equal(got, neoflow.compile(plain).run({"x": x})["logits"])


def test_an_inference_graph_reading_a_running_statistic_output_is_refused() -> None:
    model = _model(0.0)
    node = model.graph.node[1]
    node.attribute.append(helper.make_attribute("training_mode", 1))
    node.output.extend(["running_mean_out", "running_var_out"])
    model.graph.output.append(helper.make_tensor_value_info("running_mean_out", TensorProto.FLOAT, [4]))
    with pytest.raises(UnsupportedOpError, match="exists only in a training step") as caught:
        neoflow.load_onnx(model, check=False)
    assert "\n" not in str(caught.value)


def test_a_model_pytorch_exports_in_training_mode_trains_like_pytorch() -> None:
    """``torch.onnx.export(..., training=TrainingMode.TRAINING)`` keeps BatchNormalization with
    ``training_mode=1`` and its running-statistics outputs: the training compiler takes it (issue 39);
    losses over three SGD steps match PyTorch's train mode, inference PyTorch's eval mode."""
    import io

    import torch.nn as nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((6, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 6).astype(np.int64)) for _ in range(3)
    ]
    buffer = io.BytesIO()
    net.train()
    torch.onnx.export(
        net,
        (torch.from_numpy(batches[0][0]),),
        buffer,
        dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        input_names=["x"],
        output_names=["logits"],
    )
    exported = onnx.load_from_string(buffer.getvalue())
    assert any(a.name == "training_mode" and a.i == 1 for n in exported.graph.node for a in n.attribute)
    with torch.no_grad():
        want_inference = net.eval()(torch.from_numpy(batches[0][0])).numpy()
    got_inference = neoflow.compile(exported).run({"x": batches[0][0]})["logits"]
    np.testing.assert_allclose(got_inference, want_inference, rtol=1e-4, atol=1e-5)
    model = neoflow.compile(exported, train=neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.1))
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        assert model.train_step({"x": x, "y": y}) == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("layer", ["batch", "layer"])
def test_a_normalisation_s_variance_sends_no_gradient_through_its_mean(layer: str) -> None:
    """The variance reads a copy of the mean autodiff holds constant (``Graph.stop_gradients``): the
    derivative through it, -2/n * sum(x - mean), is zero exactly, so the backward pass has no reduction
    computing it (it was one more pass over the activation, and only its rounding noise); the gradients
    stay as close to the exact ones as PyTorch's float32 gradients, on an input of mean 100 and deviation
    0.01 where the noise is largest."""
    import io

    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(3) if layer == "batch" else torch.nn.LayerNorm([3, 4, 4])
    conv = torch.nn.Conv2d(3, 3, 1)  # its weights' gradient is the normalisation's input gradient
    with torch.no_grad():
        conv.bias.fill_(100.0)
    net = torch.nn.Sequential(conv, norm, torch.nn.Flatten(), torch.nn.Linear(48, 5))
    x = 0.01 * torch.randn(8, 3, 4, 4)
    y = torch.randint(0, 5, (8,))
    buffer = io.BytesIO()
    torch.onnx.export(
        net.train(), (x,), buffer, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
    )  # fmt: skip
    model = neoflow.compile(onnx.load_from_string(buffer.getvalue()), target="interp", train=neoflow.TrainSpec())
    mean = next(op.name for op in model.training.graph.ops if op.name.endswith("_mean__" + op.name.split("__")[-1]))
    assert not [op.name for op in model.training.graph.ops if op.name.startswith(f"grad_{mean}_part")]
    got = model.gradients({"x": x.numpy(), "labels": y.numpy()})
    F.cross_entropy(net(x), y).backward()  # PyTorch in float32: the accuracy to hold
    single = {name: p.grad.numpy().copy() for name, p in net.named_parameters()}
    exact = net.double()
    exact.zero_grad()
    F.cross_entropy(exact(x.double()), y).backward()
    for name, parameter in exact.named_parameters():
        want = parameter.grad.numpy()
        ours, theirs = (np.abs(g[name] - want).max() / np.abs(want).max() for g in (got, single))
        assert ours <= 3 * theirs + 1e-6, (name, ours, theirs)
