"""Bad ONNX input is a one-line error naming the node and the cause; the CLI exits non-zero and writes nothing."""

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import neoflow
from neoflow.cli import main
from neoflow.errors import InputError, NeoflowError, UnsupportedOpError

MODELS = Path(__file__).resolve().parents[2] / "models"


def model_of(*nodes, inputs=(("x", [2, 3]),), outputs=(("y", [2, 3]),), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes),
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def one_line(err: NeoflowError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_truncated_file(tmp_path) -> None:
    data = (MODELS / "cnn.onnx").read_bytes()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as info:
        neoflow.load_onnx(tmp_path / "cut.onnx")
    assert "is not an ONNX model (or is truncated)" in one_line(info.value)


def test_not_onnx(tmp_path) -> None:
    (tmp_path / "text.onnx").write_text("hello, I am not a model")
    with pytest.raises(InputError, match="is not an ONNX model"):
        neoflow.load_onnx(tmp_path / "text.onnx")


def test_checker_failure() -> None:
    bad = model_of(helper.make_node("Relu", ["nowhere"], ["y"]))
    with pytest.raises(InputError) as info:
        neoflow.load_onnx(bad)
    assert one_line(info.value).startswith("input error: the model fails onnx.checker:")


def test_unsupported_op_names_the_node() -> None:
    model = model_of(helper.make_node("Hardmax", ["x"], ["y"], name="the_hardmax"))
    with pytest.raises(UnsupportedOpError) as info:
        neoflow.load_onnx(model)
    assert one_line(info.value) == "unsupported: node 'the_hardmax': op type 'Hardmax' is not supported"


def test_bad_attribute_value_names_the_node() -> None:
    model = model_of(helper.make_node("Transpose", ["x"], ["y"], name="t", perm=[0, 5]), outputs=(("y", [3, 2]),))
    with pytest.raises(NeoflowError) as info:
        neoflow.load_onnx(model)
    assert one_line(info.value) == ("unsupported: node 't': Transpose: perm [0, 5] is not a permutation of the 2 axes")


def test_mismatched_input_shapes_name_the_node() -> None:
    model = model_of(helper.make_node("Add", ["x", "z"], ["y"], name="adder"), inputs=(("x", [2, 3]), ("z", [4, 3])))
    with pytest.raises(NeoflowError) as info:
        neoflow.load_onnx(model)
    assert one_line(info.value) == "shape error: node 'adder': input shapes [2, 3] and [4, 3] do not broadcast"


def test_cli_exits_non_zero_and_writes_nothing(tmp_path, capsys) -> None:
    (tmp_path / "text.onnx").write_text("not a model")
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "text.onnx"), "--random", "-o", str(out)]) == 1
    assert not out.exists()
    assert capsys.readouterr().err.count("\n") == 1


def test_input_file_is_not_modified(tmp_path) -> None:
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "mlp.onnx")
    before = (tmp_path / "mlp.onnx").read_bytes()
    assert main(["run", str(tmp_path / "mlp.onnx"), "--random", "-o", str(tmp_path / "o")]) == 0
    assert (tmp_path / "mlp.onnx").read_bytes() == before
    assert np.load(tmp_path / "o" / "logits.npy").shape == (32, 10)
