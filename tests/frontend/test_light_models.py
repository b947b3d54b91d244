"""The nine light_* models shipped in the onnx wheel import and reproduce the shipped outputs,
with the inputs onnx's backend test runner gives them."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.backend.test.runner import Runner

import neoflow
from tests.on_targets import evaluate_on

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = [
    "resnet50",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "bvlc_alexnet",
    "vgg19",
    "zfnet512",
    "squeezenet",
    "shufflenet",
]


@pytest.mark.parametrize("name", MODELS)
def test_light_model_reproduces_the_shipped_output(name: str, target: str) -> None:
    path = LIGHT / f"light_{name}.onnx"
    model = onnx.load(path)
    graph = neoflow.load_onnx(path)
    initializers = {t.name for t in model.graph.initializer}
    onnx_to_neoflow = {onnx_name: name for name, onnx_name in graph.source_names.items()}
    inputs = {
        onnx_to_neoflow[v.name]: Runner.generate_dummy_data(v, seed=0, name=f"light_{name}", random=False)
        for v in model.graph.input
        if v.name not in initializers
    }
    expected = numpy_helper.to_array(onnx.load_tensor(LIGHT / f"light_{name}_output_0.pb"))
    out = evaluate_on(target, graph, inputs)[graph.outputs[0]]
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-7)  # the onnx runner's tolerances
