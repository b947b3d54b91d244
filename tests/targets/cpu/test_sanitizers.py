"""Generated C built with -fsanitize=address,undefined runs clean: the test models' programs, the inference
of every onnx ``light_*`` model and the CIFAR ResNet-18's training step, each as compiled (the sanitized
builds are cached by their source, as kernels are)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

import neoflow
from neoflow.architectures import build, export
from neoflow.fusion import apply_plan
from neoflow.runtime.fusing import slice_runs
from neoflow.targets.cpu.compiler import build_sanitized
from neoflow.targets.cpu.executor import sanitizer_program
from tests.frontend.test_light_models import MODELS as LIGHT_MODELS
from tests.fusion.test_slicing import capsule_step_plans
from tests.on_targets import NEEDS_CC
from tests.targets.cpu.test_nest import TAIL

pytestmark = NEEDS_CC
MODELS = Path(__file__).resolve().parents[3] / "models"
FOUR_OP_SMALL = (MODELS / "four_op.nf").read_text().replace("224", "16").replace("228", "20").replace("226", "18")
FOUR_OP_SMALL = FOUR_OP_SMALL.replace("112", "8")


def _graphs():
    """(name, graph, kernel groups, sliced kernels) of each program built."""
    yield "mlp-train", neoflow.compile(MODELS / "mlp.onnx", train=neoflow.TrainSpec(labels="y")).training.graph, (), ()
    spec = neoflow.TrainSpec(labels="y", optimizer="adam")
    yield "cnn-train", neoflow.compile(MODELS / "cnn.onnx", train=spec).training.graph, (), ()
    yield "capsule-train", neoflow.compile(MODELS / "capsule.onnx", train=spec).training.graph, (), ()
    # neoflow's plan of it: forward and backward slice by slice, intermediates in slice buffers
    planned, plans, _ = capsule_step_plans(spec)
    fused, groups = apply_plan(planned, plans["neoflow"])
    yield "capsule-train-sliced", fused, groups, slice_runs(plans["neoflow"], groups)
    yield "upsampler", neoflow.load_onnx(MODELS / "upsampler.onnx"), (), ()
    four = neoflow.graph(FOUR_OP_SMALL)
    weights = {"C": np.full(four.tensors["C"].shape, 0.1, np.float32)}
    spec = neoflow.TrainSpec(loss="mse", labels="T")
    yield "four-op-train", neoflow.compile(four, train=spec, parameters=weights).training.graph, (), ()
    # F, the loss over it and its gradient as one loop nest
    yield "loss-tail-nest", neoflow.graph(TAIL), [("F", "loss", "G")], ()


def _run_sanitized(program: str) -> None:
    """Build ``program`` with AddressSanitizer and UBSan (cached by its source) and run it: clean, or the
    first report fails the test."""
    binary = build_sanitized(program)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
    }
    run = subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and "runtime error" not in run.stderr, run.stderr[:3000]
    assert run.stdout.startswith("checksum")


@pytest.mark.parametrize(
    ("name", "graph", "groups", "sliced"), list(_graphs()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_generated_code_is_clean_under_asan_and_ubsan(name, graph, groups, sliced) -> None:
    program = sanitizer_program(graph, groups, sliced)
    assert ("nf_nest0(" in program) == bool(groups)
    assert ("nf_sliced0(b);" in program) == bool(sliced)
    _run_sanitized(program)


LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_the_inference_of_every_light_model_is_clean_under_asan_and_ubsan(name: str) -> None:
    """Each onnx ``light_*`` model compiled as ``neoflow.compile`` does by default (every op its own
    kernel; the tuned choices where the table has them), at its own shapes."""
    model = neoflow.compile(LIGHT / f"light_{name}.onnx", target="cpu")
    _run_sanitized(model.inference_executor.sanitizer_program())


def test_the_resnet_training_step_is_clean_under_asan_and_ubsan() -> None:
    """The benchmark's CIFAR ResNet-18 (width 64, batch 32) exported in training mode: BatchNorm on batch
    statistics, residual adds, the backward pass, SGD with momentum, as the neoflow plan fuses them."""
    proto = onnx.load_from_string(export(build("resnet18"), 32, train=True))
    spec = neoflow.TrainSpec(labels="labels", optimizer="momentum", momentum=0.9)
    model = neoflow.compile(proto, target="cpu", train=spec, fusion="neoflow")  # as benchmarks.models runs it
    executor, _ = model.executor_and_feed(model.example_batch(training=True), training=True)
    assert any(len(group) > 1 for group in executor.kernel_groups)  # the plan's fused kernels are in it
    _run_sanitized(executor.sanitizer_program())
