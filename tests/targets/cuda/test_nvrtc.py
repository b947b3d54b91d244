"""Every CUDA kernel the tests plan compiles with NVRTC for sm_90 and sm_80 (no GPU needed), and
the tensor-core kernels keep every value in registers (no spills, read from ptxas's report)."""

from __future__ import annotations

import dataclasses

import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.ir.graph import Graph
from neoflow.targets import cache
from neoflow.targets.cuda import nvrtc
from neoflow.targets.cuda.emit import PRELUDE, module_source
from neoflow.targets.cuda.executor import graph_plans
from neoflow.targets.cuda.plan import (
    DEFAULT_ARCH,
    TUNER_TILES,
    WGMMA_TILES,
    MmaKernel,
    OpPlan,
    allowed_tiles,
    plan_op,
    producer_twin,
    whole_copies,
)
from tests.targets.cuda.gpu_cases import (
    WGMMA_PRODUCTS,
    all_ops,
    capsule,
    conv_relu,
    long_sums,
    masked_gradient,
    masked_input_gradient,
    needs_nvrtc,
    softmax_parts,
    wgmma_plan,
)

pytestmark = needs_nvrtc

ARCHS = ("sm_90", "sm_80")
PRECISIONS = ("fp16", "tf32", "bf16", "fp32")


def _plans() -> list[OpPlan]:
    """The kernels of the model tests: capsule conv and adjoints (both strides), the padded conv with
    its epilogue (and its adjoints' SIMT kernels), float16 matrix products, each precision, and a
    long-depth product in every tile and a split depth."""
    ops = [*all_ops(capsule(1)), *all_ops(capsule(2)), *all_ops(conv_relu()), *all_ops(long_sums()), masked_gradient()]
    ops += all_ops(softmax_parts())  # reductions computed once a point and read by name
    plans = [plan_op(op, f"k{n}_{p}", p) for n, op in enumerate(ops) for p in PRECISIONS]
    half = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (70, 40), "B": (40, 50)}, dtype="float16"
    )
    plans.append(plan_op(half, "k_half", "fp16"))
    long_depth = neoflow.grad(capsule(2, batch=3, channels=16, out=6))["W"]
    for precision in ("fp16", "tf32"):  # through registers (fp16 from float32), and by cp.async (tf32)
        base = plan_op(long_depth, "long", precision).kernels[0]
        for n, tiles in enumerate(allowed_tiles(base, tuner=True)):  # the tuner's sliced depths too
            kernel = dataclasses.replace(base, name=f"tile{n}_{precision}", tiles=tiles, splits=1 + n % 3)
            if whole_copies(kernel):
                plans.append(OpPlan(long_depth, (kernel,), True))
            twin = producer_twin(kernel) if whole_copies(kernel) else None
            if twin is not None:  # warp-specialised: a producer warpgroup copies the stages
                plans.append(OpPlan(long_depth, (dataclasses.replace(twin, name=f"{kernel.name}_p"),), True))
    # a transposed conv: its input adjoint gathers float32 pairs (8-byte vectors) in tf32
    transposed = neoflow.op(
        "Y[n, k, l] = ReduceAdd({c, r}, Select((l - r) % 2 == 0 && (l - r) // 2 >= 0 && (l - r) // 2 < 16, "
        "X[n, c, (l - r) // 2], 0) * W[c, k, r])",
        shapes={"X": (4, 32, 16), "W": (32, 32, 4)},
        out_shape=(4, 32, 34),
    )
    plans += [plan_op(op, f"tc{n}_{p}", p) for n, op in enumerate(all_ops(transposed)) for p in ("tf32", "fp16")]
    # a masked operand copied tensor by tensor and combined as the fragments are read: tf32 element by
    # element and by ldmatrix, float16 pairs by ldmatrix (plain and transposed)
    for dtype, precision in (("float32", "tf32"), ("float16", "fp16")):
        for n, op in enumerate((masked_gradient(dtype), masked_input_gradient(dtype))):
            plans.append(plan_op(op, f"masked{n}_{precision}", precision))
            assert any(plans[-1].kernels[0].combined(side) for side in ("a", "b"))
            twin = producer_twin(plans[-1].kernels[0])
            if twin is not None:
                plans.append(OpPlan(op, (dataclasses.replace(twin, name=f"masked{n}_{precision}_p"),), False))
    # float16 tensors in every precision: a float16 sum beside a float16 mask in an epilogue (a float
    # accumulator there made '*' ambiguous), vectors of eight converted to tf32 (stored as two float4)
    plans += [
        plan_op(op, f"hm{n}_{p}", p) for n, op in enumerate(all_ops(masked_gradient("float16"))) for p in PRECISIONS
    ]
    # float16 tensors: copied by cp.async, 8 bytes a copy
    plans += [plan_op(op, f"h{n}", "fp16") for n, op in enumerate(all_ops(capsule(1, channels=16, dtype="float16")))]
    return plans


@pytest.fixture(scope="module")
def source() -> str:
    return module_source(_plans())


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills(source: str, arch: str) -> None:
    cubin = nvrtc.compile_cubin(source, arch)
    assert cubin.path.is_file() and cubin.path.stat().st_size > 0
    mma = [k.name for plan in _plans() for k in plan.kernels if isinstance(k, MmaKernel)]
    assert len(mma) >= 20
    missing = [name for name in mma if name not in cubin.spills]
    assert not missing, f"ptxas reported nothing for {missing}"
    spilled = {name: cubin.spills[name] for name in mma if cubin.spills[name]}
    if arch != DEFAULT_ARCH:  # a layout only the tuner tries is timed only where it does not spill
        tuner_only = {k.name for plan in _plans() for k in plan.kernels if getattr(k, "tiles", None) in TUNER_TILES}
        spilled = {name: stores for name, stores in spilled.items() if name not in tuner_only}
    assert not spilled, f"tensor-core kernels spill registers on {arch}: {spilled}"


def test_operand_copies_are_cached_in_l1(source: str) -> None:
    # a gather re-reads an input element once per window tap: copies bypassing L1 (.cg) re-read L2
    kernels = source.removeprefix(PRELUDE)
    assert "nf_copy<" in kernels and "nf_copy_cg(" not in kernels


def _wgmma_plans() -> list[OpPlan]:
    return [wgmma_plan(name, tiles, splits) for name in WGMMA_PRODUCTS for tiles in WGMMA_TILES for splits in (1, 2)]


def test_wgmma_kernels_build_for_hopper_alone_without_spills() -> None:
    source = module_source(_wgmma_plans())
    kernels = source.removeprefix(PRELUDE)
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in kernels
    assert "nf_copy_cg(" in kernels and "nf_copy<" not in kernels  # tiles read once a block: past L1
    cubin = nvrtc.compile_cubin(source, "sm_90")  # built as sm_90a: plain sm_90 has no wgmma
    names = [k.name for plan in _wgmma_plans() for k in plan.kernels]
    assert all(cubin.spills[name] == 0 for name in names), cubin.spills
    assert all(cubin.registers[name] <= 65536 // 384 for name in names)  # one block of 384 threads an SM
    with pytest.raises(CompileError):
        nvrtc.compile_cubin(source, "sm_80")


def test_the_compile_cache_answers_without_nvrtc(source: str, monkeypatch) -> None:
    first = nvrtc.compile_cubin(source, "sm_90")
    monkeypatch.setattr(nvrtc, "_check", lambda *a: pytest.fail("NVRTC was called for a cached module"))
    again = nvrtc.compile_cubin(source, "sm_90")
    assert again.path == first.path and again.spills == first.spills


def test_a_truncated_cubin_is_built_again() -> None:
    source = 'extern "C" __global__ void nf_tiny(float *x) { x[threadIdx.x] = 2.0f * x[threadIdx.x]; }\n'
    first = nvrtc.compile_cubin(source, "sm_90")
    whole = first.path.read_bytes()
    first.path.write_bytes(whole[: len(whole) // 3])
    again = nvrtc.compile_cubin(source, "sm_90")
    assert again.path == first.path and cache.intact(again.path) and len(again.path.read_bytes()) == len(whole)


def test_bad_cuda_is_a_one_line_compile_error() -> None:
    with pytest.raises(CompileError) as caught:
        nvrtc.compile_cubin('extern "C" __global__ void broken() { undefined_name(); }', "sm_90")
    message = str(caught.value)
    assert "\n" not in message and "undefined_name" in message and "sm_90" in message


def test_a_graph_module_names_each_op_kernel() -> None:
    op = capsule(1)
    graph = Graph.from_ops(all_ops(op), outputs=[o.name for o in all_ops(op)])
    source = module_source(graph_plans(graph, "tf32"))
    for k in range(len(graph.ops)):
        assert f" nf_op{k}(" in source
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in source


@pytest.mark.parametrize("model", ["mlp.onnx", "cnn.onnx", "capsule.onnx", "capsule28.onnx"])
def test_training_steps_of_the_shipped_models_compile(model: str) -> None:
    from pathlib import Path

    models = Path(__file__).resolve().parents[3] / "models"
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd")
    for precision in ("tf32", "fp32"):
        compiled = neoflow.compile(models / model, target="cuda", train=spec, fusion="neoflow", precision=precision)
        for executor in (compiled._run, compiled._train):
            mma = {k.name for plan in executor.plans.values() for k in plan.kernels if isinstance(k, MmaKernel)}
            if executor is compiled._train and precision == "tf32":
                assert mma, f"{model}: no contraction of the training step runs on the tensor cores"
            spilled = {name: size for name, size in executor.cubin.spills.items() if size and name in mma}
            assert not spilled, f"{model} {precision}: tensor-core kernels spill {spilled}"
