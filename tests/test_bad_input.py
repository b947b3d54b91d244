"""Every public entry point answers bad input with a one-line ``neoflow`` error (issue 40 point 1): the
Python API raises only ``NeoflowError`` subclasses, the CLI exits 1 (2 for argument syntax) with one line."""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.cli import main
from neoflow.errors import NeoflowError

MODELS = Path(__file__).resolve().parent.parent / "models"
CNN = MODELS / "cnn.onnx"
X = np.zeros((32, 1, 8, 8), np.float32)
Y = np.zeros(32, np.int64)


@pytest.fixture(scope="module")
def cnn():
    return neoflow.compile(CNN, target="interp", train=neoflow.TrainSpec(labels="y"))


def _objects(shape) -> np.ndarray:
    return np.array([None] * int(np.prod(shape)), dtype=object).reshape(shape)


MODEL_CALLS: dict[str, Callable] = {
    "run without inputs": lambda m: m.run({}),
    "run with an extra input": lambda m: m.run({"x": X, "zz": X}),
    "run with a wrong shape": lambda m: m.run({"x": X[:3]}),
    "run with strings": lambda m: m.run({"x": X.astype(str)}),
    "run with objects": lambda m: m.run({"x": _objects(X.shape)}),
    "run with complex numbers": lambda m: m.run({"x": X.astype(np.complex64)}),
    "run with None": lambda m: m.run({"x": None}),
    "run with a list of inputs": lambda m: m.run([X]),
    "run with a scalar": lambda m: m.run({"x": 3.0}),
    "train without labels": lambda m: m.train_step({"x": X}),
    "train without data": lambda m: m.train_step({"y": Y}),
    "train with an extra input": lambda m: m.train_step({"x": X, "y": Y, "q": 1}),
    "train with float labels": lambda m: m.train_step({"x": X, "y": Y + 0.5}),
    "train with labels out of range": lambda m: m.train_step({"x": X, "y": Y + 100}),
    "train with negative labels": lambda m: m.train_step({"x": X, "y": Y - 1}),
    "train with string labels": lambda m: m.train_step({"x": X, "y": Y.astype(str)}),
    "train with a wrong shape": lambda m: m.train_step({"x": X[:, :, :4], "y": Y}),
    "train with a list": lambda m: m.train_step([X, Y]),
    "gradients without labels": lambda m: m.gradients({"x": X}),
    "set an unknown parameter": lambda m: m.set_parameters({"nope": 1}),
    "set a parameter of a wrong shape": lambda m: m.set_parameters({"c1": np.zeros(3)}),
    "set a parameter to strings": lambda m: m.set_parameters({"c1": m.parameters()["c1"].astype(str)}),
    "a learning rate of NaN": lambda m: setattr(m, "lr", float("nan")),
    "a learning rate that is text": lambda m: setattr(m, "lr", "fast"),
    "save into a file": lambda m: m.save(CNN),
    "save where no directory can be": lambda m: m.save("/proc/neoflow/build"),
    "export where no file can be": lambda m: m.export_onnx("/proc/neoflow/x.onnx"),
}


@pytest.mark.parametrize("call", MODEL_CALLS.values(), ids=MODEL_CALLS.keys())
def test_a_compiled_model_answers_bad_input_with_a_neoflow_error(cnn, call) -> None:
    before = {name: value.copy() for name, value in cnn.parameters().items()}
    with pytest.raises(NeoflowError) as caught:
        call(cnn)
    assert "\n" not in str(caught.value)
    after = cnn.parameters()
    assert all(np.array_equal(after[name], value) for name, value in before.items())  # nothing half-applied


OP = "Y[i] = X[i] * 2"


def _doubler():
    return neoflow.compile(neoflow.op(OP, shapes={"X": (3,)}), grad=True)


CALLS: dict[str, Callable] = {
    "compile an unknown target": lambda: neoflow.compile(CNN, target="tpu"),
    "compile an unknown fusion policy": lambda: neoflow.compile(CNN, fusion="nope"),
    "compile with an unknown precision": lambda: neoflow.compile(CNN, precision="fp8"),
    "compile with shapes that do not fit": lambda: neoflow.compile(CNN, shapes={"x": (1, 2)}),
    "compile with a negative dimension": lambda: neoflow.compile(CNN, shapes={"x": (-1, 1, 8, 8)}),
    "compile with a shape of text": lambda: neoflow.compile(CNN, shapes={"x": "abc"}),
    "compile with a shape of floats": lambda: neoflow.compile(CNN, shapes={"x": (1.5, 1, 8, 8)}),
    "compile with shapes of an unknown input": lambda: neoflow.compile(CNN, shapes={"zz": (1,)}),
    "compile with an unknown parameter": lambda: neoflow.compile(CNN, parameters={"zz": np.zeros(1)}),
    "compile an unknown loss": lambda: neoflow.compile(CNN, train=neoflow.TrainSpec(loss="nope")),
    "compile an unknown optimizer": lambda: neoflow.compile(CNN, train=neoflow.TrainSpec(labels="y", optimizer="x")),
    "a negative learning rate": lambda: neoflow.TrainSpec(labels="y", lr=-1),
    "an infinite learning rate": lambda: neoflow.TrainSpec(labels="y", lr=float("inf")),
    "labels named as an input": lambda: neoflow.compile(CNN, train=neoflow.TrainSpec(labels="x")),
    "freeze an unknown parameter": lambda: neoflow.compile(CNN, train=neoflow.TrainSpec(labels="y", frozen=("z",))),
    "compile a missing file": lambda: neoflow.compile("nope.onnx"),
    "compile a directory": lambda: neoflow.compile(MODELS),
    "compile a number": lambda: neoflow.compile(3),
    "compile None": lambda: neoflow.compile(None),
    "load_onnx of bytes": lambda: neoflow.load_onnx(b"garbage"),
    "load a missing build": lambda: neoflow.load("nope"),
    "load a model file as a build": lambda: neoflow.load(CNN),
    "an op with a dropped bracket": lambda: neoflow.op("Y[i] = X[i", shapes={"X": (3,)}),
    "an op without shapes": lambda: neoflow.op(OP),
    "an op with a negative dimension": lambda: neoflow.op(OP, shapes={"X": (-3,)}),
    "an op with a shape of text": lambda: neoflow.op(OP, shapes={"X": "a"}),
    "an op with shapes not a mapping": lambda: neoflow.op(OP, shapes=[(3,)]),
    "an op with an unknown dtype": lambda: neoflow.op(OP, shapes={"X": (3,)}, dtypes={"X": "float7"}),
    "an op that is not text": lambda: neoflow.op(5),
    "a graph with a doubled equals sign": lambda: neoflow.graph("Y[i] = = X[i]"),
    "an empty graph": lambda: neoflow.graph(""),
    "evaluate without inputs": lambda: neoflow.evaluate(neoflow.graph("X = tensor([3])\nY[i] = X[i]"), {}),
    "evaluate with a wrong shape": lambda: neoflow.evaluate(
        neoflow.graph("X = tensor([3])\nY[i] = X[i]"), {"X": np.zeros(4)}
    ),
    "evaluate with strings": lambda: neoflow.evaluate(
        neoflow.graph("X = tensor([3])\nY[i] = X[i]"), {"X": np.array(["a", "b", "c"])}
    ),
    "an op run with a wrong shape": lambda: neoflow.compile(neoflow.op(OP, shapes={"X": (3,)})).run({"X": np.zeros(4)}),
    "an op run with strings": lambda: neoflow.compile(neoflow.op(OP, shapes={"X": (3,)})).run(
        {"X": np.array(["a"] * 3)}
    ),
    "an op run with an array for its inputs": lambda: neoflow.compile(neoflow.op(OP, shapes={"X": (3,)})).run(
        np.zeros(3)
    ),
    "an op's integer input given floats": lambda: neoflow.compile(
        neoflow.op(OP, shapes={"X": (3,)}, dtypes={"X": "int32"})
    ).run({"X": np.full(3, 0.5)}),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_the_api_answers_bad_input_with_a_neoflow_error(call) -> None:
    with pytest.raises(NeoflowError) as caught:
        call()
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Builds and files the CLI cases read."""
    root = tmp_path_factory.mktemp("bad")
    neoflow.compile(CNN, train=neoflow.TrainSpec(labels="y")).save(root / "build")
    neoflow.compile(CNN).save(root / "inference")
    np.save(root / "wrong.npy", np.zeros((2, 2)))
    (root / "text.npy").write_text("hello")
    (root / "empty.npz").write_text("")
    np.savez(root / "strings.npz", x=np.array(["a"] * 640).reshape(10, 64), y=np.zeros(10))
    np.savez(root / "unlabelled.npz", x=np.zeros((10, 64)))
    damaged = root / "damaged"
    neoflow.compile(CNN).save(damaged)
    (damaged / "model.onnx").write_bytes((damaged / "model.onnx").read_bytes()[:-10])
    return root


# {D}: the files fixture's folder; each line is one command a user might type
CLI_CASES = """
show 'Y[i] = X[i]'
show 'Y[i] = X[i]' --shape X=-3
show 'Y[i] = X[i]' --shape X=a
show 'Y[i] = X[i]' --shape X=3 --dtype X=float7
show 'Y[i] = X[i]' --shape X=3 --default-dtype nope
show {D}/missing.nf
show {D}
show models/cnn.onnx --shape x=1,2
show models/cnn.onnx --shape x=0,1,8,8
run 'Y[i] = X[i]' --shape X=3
run 'Y[i] = X[i]' --shape X=3 --input X={D}/wrong.npy
run 'Y[i] = X[i]' --shape X=3 --input X={D}/text.npy
run 'Y[i] = X[i]' --shape X=3 --input X={D}/missing.npy
run 'Y[i] = X[i]' --shape X=3 --input Z={D}/wrong.npy --random
run 'Y[i] = X[i]' --shape X=3 --random -o /proc/neoflow
run 'Y[i] = X[i]' --shape X=3 --random -o {D}/wrong.npy
run 'Y[i] = X[i]' --shape X=3 --random --seed -5
run {D}/build
run {D}/build --input x={D}/wrong.npy
run {D}/inference --random --shape x=1,2
run {D}/damaged --random
grad 'Y[i] = X[i]' --shape X=3 --wrt Z
grad 'Y[i] = floor(X[i])' --shape X=3
compile {D}/missing.onnx
compile models/cnn.onnx --target nope
compile models/cnn.onnx --target npu:{D}/missing.json
compile models/cnn.onnx --target npu:{D}/text.npy
compile models/cnn.onnx --fusion nope
compile models/cnn.onnx --fusion os:path
compile models/cnn.onnx -o {D}/wrong.npy
compile models/cnn.onnx -o /proc/neoflow
compile models/cnn.onnx --train --labels y --lr nan
compile models/cnn.onnx --train --labels y --momentum 2
compile models/cnn.onnx --train --labels y --freeze nope
compile models/cnn.onnx --precision fp16
compile models/cnn.onnx --shape y=3
fuse {D}/missing.onnx
fuse models/cnn.onnx --compare none,nope
fuse models/cnn.onnx --repeats 0
fuse models/cnn.onnx --report /proc/neoflow/x.md
tune {D}/missing.onnx
tune models/cnn.onnx --budget nan
tune models/cnn.onnx --fusion nope
train {D}/missing --data digits
train {D}/inference --data digits
train {D}/damaged --data digits
train {D}/build --data nope
train {D}/build --data {D}/empty.npz
train {D}/build --data {D}/strings.npz
train {D}/build --data {D}/unlabelled.npz
train {D}/build --data digits --epochs 0
train {D}/build --data digits --batch 0
train {D}/build --data digits --lr nan
train {D}/build --data digits --nproc 0
train {D}/build --data digits --nproc 2 --batch 33
fuse --corpus {D}/missing
fuse --corpus --compare none,nope
fuse models/cnn.onnx --compare none,neoflow --rounds 1
fuse models/cnn.onnx --compare none,neoflow --seconds nan
"""


@pytest.mark.parametrize("line", CLI_CASES.strip().splitlines())
def test_every_command_answers_bad_input_with_one_line(files, line, monkeypatch) -> None:
    monkeypatch.chdir(MODELS.parent)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(shlex.split(line.replace("{D}", str(files))))
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    last = err.getvalue().strip().splitlines()[-1]
    assert code in (1, 2), err.getvalue()
    assert last.startswith("neoflow") and "internal error" not in last, last
