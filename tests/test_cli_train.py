"""neoflow compile --train and neoflow train, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neoflow.cli import main
from tests.on_targets import NEEDS_CC

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_compile_train_digits_cnn_reaches_95_percent_and_exports_onnx(tmp_path: Path, capsys) -> None:
    pytest.importorskip("sklearn")
    ort = pytest.importorskip("onnxruntime")
    build = tmp_path / "build"
    args = ["compile", str(MODELS / "cnn.onnx"), "--train", "--loss", "cross_entropy", "--labels", "y"]
    assert main([*args, "--optimizer", "adam", "--lr", "1e-2", "-o", str(build)]) == 0
    out = capsys.readouterr().out
    assert "training step:" in out and "peak live memory" in out
    train = json.loads((build / "manifest.json").read_text())["train"]
    assert train["optimizer"] == "adam" and train["keep_prediction"]  # the training accuracy is counted from it
    assert main(["train", str(build), "--data", "digits", "--epochs", "10", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "epoch 10/10" in out and "train acc" in out
    final = float(out.split("test accuracy ")[1].split("%")[0])
    assert final >= 95.0, out
    # the exported model predicts the same under onnxruntime as under neoflow
    from sklearn.datasets import load_digits

    x = (load_digits().data[:64] / 16.0).astype(np.float32).reshape(64, 1, 8, 8)
    session = ort.InferenceSession(str(build / "trained.onnx"), providers=["CPUExecutionProvider"])
    import neoflow

    ours = neoflow.compile(build / "trained.onnx")
    for half in (x[:32], x[32:]):
        np.testing.assert_array_equal(
            session.run(None, {"x": half})[0].argmax(1), ours.run({"x": half})["logits"].argmax(1)
        )


def test_train_from_npz_with_mse_and_another_batch(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 64)).astype(np.float32)
    y = (x[:, :10] > 0).argmax(axis=1)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    build = tmp_path / "b"
    assert (
        main(["compile", str(MODELS / "mlp.onnx"), "--train", "--loss", "mse", "--labels", "t", "-o", str(build)]) == 0
    )
    capsys.readouterr()
    out_file = tmp_path / "mlp_trained.onnx"
    code = main(
        [
            "train",
            str(build),
            "--data",
            str(tmp_path / "data.npz"),
            "--epochs",
            "2",
            "--batch",
            "16",
            "-o",
            str(out_file),
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "batch 16" in out and "epoch 2/2" in out and out_file.is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "{models}", "--data", "digits"], "is not a neoflow build directory"),
        (["train", "{build}", "--data", "nothing.npz"], "no such data set"),
        (["train", "{build}", "--data", "{bad}"], "the data's samples have shape [5] (5 values)"),
        (["train", "{build}", "--data", "digits", "--epochs", "0"], "--epochs must be at least 1"),
        (["compile", "{models}/mlp.onnx", "--train", "--loss", "logits", "-o", "{tmp}/x"], "a loss must be a scalar"),
        (["compile", "{models}/mlp.onnx", "--train", "--freeze", "w7", "-o", "{tmp}/x"], "'w7' does not exist"),
    ],
)
def test_errors_are_one_line(tmp_path: Path, capsys, argv, message) -> None:
    build = tmp_path / "build"
    assert main(["compile", str(MODELS / "mlp.onnx"), "--train", "--labels", "y", "-o", str(build)]) == 0
    np.savez(tmp_path / "bad.npz", x=np.zeros((40, 5)), y=np.zeros(40, np.int64))
    capsys.readouterr()
    names = {"models": MODELS, "build": build, "bad": tmp_path / "bad.npz", "tmp": tmp_path}
    assert main([a.format(**names) for a in argv]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # no half-written build


@NEEDS_CC
def test_compile_for_cpu_writes_source_library_and_runs(tmp_path: Path, capsys) -> None:
    build = tmp_path / "build"
    assert (
        main(["compile", str(MODELS / "cnn.onnx"), "--target", "cpu", "--train", "--labels", "y", "-o", str(build)])
        == 0
    )
    names = {p.name for p in build.iterdir()}
    assert {"inference.c", "inference.so", "train_step.c", "train_step.so", "manifest.json", "model.onnx"} <= names
    assert "#pragma omp parallel for" in (build / "train_step.c").read_text()
    capsys.readouterr()
    x = np.random.default_rng(0).standard_normal((32, 1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(build), "--input", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "out")]) == 0
    assert "target cpu" in capsys.readouterr().out
    import neoflow

    expected = neoflow.compile(MODELS / "cnn.onnx").run({"x": x})["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "out" / "logits.npy"), expected, rtol=1e-5, atol=1e-6)


def test_compile_with_a_fusion_policy_records_it_and_reloads_with_it(tmp_path: Path, capsys) -> None:
    import neoflow

    build = tmp_path / "fused"
    args = ["compile", str(MODELS / "mlp.onnx"), "--train", "--labels", "y", "--fusion", "elementwise"]
    assert main([*args, "-o", str(build)]) == 0
    assert json.loads((build / "manifest.json").read_text())["fusion"] == "elementwise"
    model = neoflow.load(build)
    assert model._train.fusion_plan.policy == "elementwise"
    assert len(model._train.fusion_plan.kernels) < len(model._train.planned_graph.ops)
    assert main(["compile", str(MODELS / "mlp.onnx"), "--fusion", "nope", "-o", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "unknown fusion policy 'nope'" in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_training_stops_with_a_one_line_message_at_the_first_non_finite_step(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[40, 3] = np.nan
    np.savez(tmp_path / "data.npz", x=x, y=rng.integers(0, 10, 64))
    build = tmp_path / "b"
    assert main(["compile", str(MODELS / "mlp.onnx"), "--train", "--labels", "y", "-o", str(build)]) == 0
    capsys.readouterr()
    code = main(["train", str(build), "--data", str(tmp_path / "data.npz"), "--epochs", "3", "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("neoflow: numeric error: training step "), err[-1]
    assert err[-1].endswith("the loss is nan"), err[-1]


def test_checkpoint_saves_after_every_epoch_and_the_next_run_goes_on(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 64)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, :10] > 0).argmax(axis=1))
    build = tmp_path / "b"
    compile_args = ["compile", str(MODELS / "mlp.onnx"), "--train", "--labels", "y", "--target", "interp"]
    assert main([*compile_args, "--optimizer", "momentum", "-o", str(build)]) == 0
    capsys.readouterr()
    train = ["train", str(build), "--data", str(tmp_path / "data.npz"), "--epochs", "2", "--no-progress"]
    assert main([*train, "--checkpoint"]) == 0
    out = capsys.readouterr().out
    assert out.count("s  saved") == 2
    first = json.loads((build / "manifest.json").read_text())["step"]
    assert first > 0
    assert main([*train, "--checkpoint"]) == 0
    assert json.loads((build / "manifest.json").read_text())["step"] == 2 * first
    assert main(train) == 0  # without --checkpoint the build is left as it was
    assert json.loads((build / "manifest.json").read_text())["step"] == 2 * first
