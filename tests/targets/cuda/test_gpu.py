"""The emitted CUDA run on a GPU against the interpreter and the tensor-core model (skipped, with the
reason, where no GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

import neoflow
from neoflow.ir.graph import Graph
from neoflow.targets.cuda.executor import CudaExecutor, ModelExecutor
from neoflow.targets.cuda.plan import WGMMA_TILES
from tests.targets.cuda.gpu_cases import (
    WGMMA_PRODUCTS,
    all_ops,
    capsule,
    conv_relu,
    gpu_reason,
    inputs_for,
    long_sums,
    masked_gradient,
    masked_input_gradient,
    softmax_parts,
    wgmma_plan,
)

REASON = gpu_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

CASES = {
    "capsule1": lambda: capsule(1),
    "capsule2": lambda: capsule(2),
    "capsule1_half": lambda: capsule(1, channels=16, dtype="float16"),
    "conv_relu": conv_relu,
    "long_sums": long_sums,
    "masked_gradient": masked_gradient,
    "masked_gradient_half": lambda: masked_gradient("float16"),
    "masked_input_gradient": masked_input_gradient,
    "softmax_parts": softmax_parts,
}
#: largest error against the interpreter's float32, relative to the largest output, per precision
TOLERANCE = {"fp32": 1e-5, "tf32": 3e-3, "fp16": 3e-3, "bf16": 2e-2}


@pytest.mark.parametrize("precision", sorted(TOLERANCE))
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_matches_interpreter_and_model(case: str, precision: str) -> None:
    for op in all_ops(CASES[case]()):
        graph = Graph.from_ops([op])
        inputs = {name: value * 0.1 for name, value in inputs_for(op, seed=1).items()}  # exp stays finite
        if op.inputs and op.inputs[0].dtype == "float16":
            inputs = {name: value.astype(np.float16) for name, value in inputs.items()}
        reference = neoflow.evaluate(op, inputs).astype(np.float32)
        executor = CudaExecutor(graph, [op.name], precision=precision)
        gpu = executor.run(inputs)[op.name].astype(np.float32)
        scale = np.abs(reference).max()
        # a second run: each split kernel's finishing kernels left its workspace zeroed (the same sums,
        # added in another order: float16 outputs one rounding apart at most)
        again = executor.run(inputs)[op.name].astype(np.float32)
        rounding = 1e-5 if op.dtype == "float32" else 1e-3
        assert np.abs(again - gpu).max() <= rounding * scale, (op.name, precision, "second run")
        # float16 tensors: the interpreter sums in float16, the kernels in float32
        tolerance = TOLERANCE[precision] if op.dtype == "float32" else 2e-2
        assert np.abs(gpu - reference).max() <= tolerance * scale, (op.name, precision)
        model = ModelExecutor(graph, [op.name], precision=precision).run(inputs)[op.name].astype(np.float32)
        same = 1e-5 if op.dtype == "float32" else 1e-3  # float16 outputs: one rounding apart at most
        assert np.abs(gpu - model).max() <= same * scale, (op.name, precision, "model")


@pytest.mark.parametrize("name", sorted(WGMMA_PRODUCTS))
def test_wgmma_kernels_on_the_gpu_match_the_interpreter(name: str, monkeypatch) -> None:
    from neoflow.targets.cuda import driver, executor

    if driver.device().arch != "sm_90":
        pytest.skip("wgmma needs a Hopper GPU (sm_90)")
    for tiles in WGMMA_TILES:
        for splits in (1, 3):
            plan = wgmma_plan(name, tiles, splits)
            monkeypatch.setattr(executor, "graph_plans", lambda *args, plan=plan: [plan])
            op = plan.op
            inputs = {n: v.astype(np.float16) for n, v in inputs_for(op, seed=2).items()}
            reference = neoflow.evaluate(op, {n: v.astype(np.float32) for n, v in inputs.items()})
            gpu = CudaExecutor(Graph.from_ops([op]), [op.name], precision="fp16")
            assert "wgmma.mma_async" in gpu.source
            for _ in range(3):  # a race between the copies and the multiplies shows up as a changing error
                got = gpu.run(inputs)[op.name].astype(np.float32)
                assert np.abs(got - reference).max() <= 2e-3 * np.abs(reference).max(), (name, tiles, splits)


@pytest.mark.parametrize("precision, dtype", [("tf32", "float32"), ("fp16", "float16")])
def test_the_tuners_layouts_and_producers_on_the_gpu_match_the_model(precision: str, dtype: str, monkeypatch) -> None:
    from neoflow.targets.cuda import executor
    from neoflow.targets.cuda.plan import TUNER_TILES, OpPlan, plan_op, producer_twin, retiled

    tried = 0
    for op in all_ops(capsule(2, channels=16, dtype=dtype)):
        inputs = {name: (value * 0.1).astype(dtype) for name, value in inputs_for(op, seed=4).items()}
        planned = plan_op(op, "k", precision)
        layouts = [retiled(planned, tiles) for tiles in TUNER_TILES] + [
            OpPlan(op, tuple(producer_twin(k) or k for k in planned.kernels), planned.zero_first)
        ]
        for plan in layouts:
            if plan is None:
                continue
            tiles = plan.kernels[0].tiles
            monkeypatch.setattr(executor, "graph_plans", lambda *args, plan=plan: [plan])
            graph = Graph.from_ops([op])
            got = CudaExecutor(graph, [op.name], precision=precision).run(inputs)[op.name].astype(np.float32)
            want = ModelExecutor(graph, [op.name], precision=precision).run(inputs)[op.name].astype(np.float32)
            same = 1e-5 if dtype == "float32" else 1e-3  # float16 outputs: one rounding apart at most
            assert np.abs(got - want).max() <= same * np.abs(want).max(), (op.name, tiles)
            tried += tiles.warps_k > 1 or plan.kernels[0].specialized
    assert tried >= 7


@pytest.mark.parametrize("model", ["mlp.onnx", "cnn.onnx", "capsule.onnx"])
def test_training_step_on_the_gpu_matches_the_interpreter(model: str) -> None:
    from pathlib import Path

    models = Path(__file__).resolve().parents[3] / "models"
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    shape = {"mlp.onnx": (32, 64)}.get(model, (32, 1, 8, 8))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal(shape).astype(np.float32), "y": rng.integers(0, 10, 32)}
    ours = neoflow.compile(models / model, target="cuda", train=spec, fusion="neoflow", precision="fp32")
    reference = neoflow.compile(models / model, target="interp", train=spec, fusion="neoflow")
    got, want = ours.gradients(batch), reference.gradients(batch)
    for name in want:
        assert np.abs(got[name] - want[name]).max() <= 1e-4 * np.abs(want[name]).max(), name
    assert ours.train_step(batch) == pytest.approx(reference.train_step(batch), rel=1e-5)


class _DlpackOnly:
    """A GPU tensor seen through DLPack alone (as a JAX array is)."""

    def __init__(self, tensor) -> None:
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_gpu_arrays_are_read_and_written_where_they_are() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    from neoflow.errors import InputError

    op = capsule(1)
    layer = neoflow.compile(op, target="cuda", grad=True, precision="tf32")
    for round_ in range(2):  # new tensors (new addresses) the second time: a second CUDA graph
        host = {name: value * 0.1 for name, value in inputs_for(op, seed=round_).items()}
        device = {name: torch.from_numpy(value).cuda() for name, value in host.items()}
        out = torch.empty(op.shape, device="cuda")
        assert layer.run(device, out=out) is out
        assert np.array_equal(out.cpu().numpy(), layer.run(host))  # the same kernels, bit for bit
        dlpack_only = {name: _DlpackOnly(tensor) for name, tensor in device.items()}
        assert np.array_equal(layer.run(dlpack_only), layer.run(host))
        d_out = torch.randn(op.shape, device="cuda")
        grads = {name: torch.empty(tuple(t.shape), device="cuda") for name, t in device.items()}
        got = layer.backward(device, {f"d{op.name}": d_out}, out=grads)
        want = layer.backward(host, {f"d{op.name}": d_out.cpu().numpy()})
        for name in want:
            assert got[name] is grads[name]
            assert np.array_equal(grads[name].cpu().numpy(), want[name])
    with pytest.raises(InputError, match="float64"):
        layer.run({name: tensor.double() for name, tensor in device.items()})
