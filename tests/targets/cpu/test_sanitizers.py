"""Generated C built with -fsanitize=address,undefined runs clean on a subset of the test models."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.fusion import apply_plan
from neoflow.runtime.fusing import slice_runs
from neoflow.targets.cpu.executor import sanitizer_program
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


@pytest.mark.parametrize(
    ("name", "graph", "groups", "sliced"), list(_graphs()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_generated_code_is_clean_under_asan_and_ubsan(name, graph, groups, sliced, tmp_path) -> None:
    source = tmp_path / f"{name}.c"
    program = sanitizer_program(graph, groups, sliced)
    assert ("nf_nest0(" in program) == bool(groups)
    assert ("nf_sliced0(b);" in program) == bool(sliced)
    source.write_text(program)
    binary = tmp_path / name
    # -march=native as the kernels are built: the AVX2 packers (vector loads, masked loads, gathers) run
    flags = [
        *("-O1", "-g", "-march=native", "-fopenmp", "-std=gnu11"),
        *("-fsanitize=address,undefined", "-fno-sanitize-recover=all"),
    ]
    build = subprocess.run(["cc", *flags, str(source), "-o", str(binary), "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[:2000]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
    }
    run = subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and "runtime error" not in run.stderr, run.stderr[:3000]
    assert run.stdout.startswith("checksum")
