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


def _external_model(tmp_path):
    """A MatMul whose weight lies in ``m.onnx.data`` beside ``m.onnx`` (as PyTorch's exporter writes it)."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 512
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = tmp_path / "exported"
    folder.mkdir()
    onnx.save_model(model, folder / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return folder / "m.onnx", weight


def test_external_data_is_read_beside_the_model_whatever_the_working_directory(tmp_path, monkeypatch) -> None:
    path, weight = _external_model(tmp_path)
    before = path.read_bytes()
    monkeypatch.chdir(tmp_path)  # not the model's folder
    x = np.ones((2, 64), np.float32)
    got = neoflow.compile(path, target="interp").run({"x": x})["y"]
    np.testing.assert_allclose(got, x @ weight, rtol=1e-6)
    assert path.read_bytes() == before  # the input file is not modified


def test_missing_external_data_is_a_one_line_error_naming_the_tensor(tmp_path) -> None:
    path, _ = _external_model(tmp_path)
    (path.parent / "m.onnx.data").unlink()
    with pytest.raises(InputError, match=r"tensor 'w': its external data file .* does not exist") as caught:
        neoflow.load_onnx(path)
    assert "\n" not in str(caught.value)


def test_a_tensor_larger_than_the_machines_memory_fails_before_anything_is_allocated() -> None:
    model = model_of(
        helper.make_node("Relu", ["x"], ["y"]), inputs=(("x", [2, 2**31, 5]),), outputs=(("y", [2, 2**31, 5]),)
    )
    with pytest.raises(neoflow.ResourceError) as info:
        neoflow.compile(model, target="interp")
    assert "tensor 'x' ([2, 2147483648, 5] float32) needs 80.0 GiB, more than this machine's" in one_line(info.value)


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=0), "blocksize must be a positive integer, got 0"),
        (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=3), "not a multiple of blocksize^2 = 9"),
        (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[0, 1]), "strides [0, 1] should be"),
        (helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 0]), "kernel [2, 0] should be positive"),
    ],
)
def test_attributes_out_of_range_name_the_node(node, message) -> None:
    model = model_of(node, inputs=(("x", [1, 8, 4, 4]),), outputs=(("y", [1, 8, 4, 4]),))
    with pytest.raises(NeoflowError) as info:
        neoflow.load_onnx(model)
    assert message in one_line(info.value)


def test_an_initializer_of_no_onnx_data_type_or_short_data_names_the_tensor() -> None:
    model = onnx.load(MODELS / "cnn.onnx")
    model.graph.initializer[0].data_type = 99
    with pytest.raises(InputError, match=f"tensor '{model.graph.initializer[0].name}' has data type 99"):
        neoflow.load_onnx(model, check=False)
    model = onnx.load(MODELS / "cnn.onnx")
    model.graph.initializer[0].dims[0] += 1
    with pytest.raises(InputError, match="its data does not match its data type FLOAT and dims"):
        neoflow.load_onnx(model, check=False)  # (onnx.checker, when run, says so first)
